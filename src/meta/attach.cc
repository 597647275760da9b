// What a pool opened on a central index gets (pool::CentralMetadata): the cache's index, a
// client of the metadata service; and, in a process that may host (a serving process or a
// daemon, not a one-shot CLI command), a standby of the service itself, so a pool without any
// cxlkvd still has a service, and the service moves when its process dies.
//
// Installed by a static initializer: programs link cxlkv_meta whole (CMake's cxlkv_api target),
// since the pool layer below never names it.
#include <memory>

#include "meta/client.h"
#include "meta/service.h"
#include "pool/pool_internal.h"

namespace cxlkv::meta {
namespace {

class Attached final : public pool::CentralMetadata {
 public:
  Attached(std::unique_ptr<MetaService> service, std::unique_ptr<CentralIndex> client)
      : service_(std::move(service)), client_(std::move(client)) {}
  ~Attached() override {
    client_.reset();   // drops this process's open reservations while a service may answer
    service_.reset();  // then hands the service to a standby
  }
  cache::IndexApi& index() override { return *client_; }
  bool RecoverProcess(uint32_t slot, uint64_t inc) override { return client_->ReclaimProcess(slot, inc); }
  const MetaService* service() const { return service_.get(); }

 private:
  std::unique_ptr<MetaService> service_;
  std::unique_ptr<CentralIndex> client_;
};

Result<std::unique_ptr<pool::CentralMetadata>> Attach(Pool& pool, const PoolOpenOptions& options) {
  std::unique_ptr<MetaService> service;
  if (options.may_host_manager && options.recovers) {
    CXLKV_ASSIGN_OR_RETURN(service, MetaService::Start(pool));
  }
  auto client = std::make_unique<CentralIndex>(pool, *pool.impl().index);
  return std::unique_ptr<pool::CentralMetadata>(new Attached(std::move(service), std::move(client)));
}

}  // namespace

const MetaService* ServiceOf(Pool& pool) {
  const auto* attached = dynamic_cast<const Attached*>(pool.impl().central.get());
  return attached == nullptr ? nullptr : attached->service();
}

namespace {

[[maybe_unused]] const bool kInstalled = [] {
  pool::RegisterCentralMetadata(&Attach);
  return true;
}();

}  // namespace
}  // namespace cxlkv::meta
