// cxlkv demo: the main job on the embedded default (a region in /dev/shm). It grows with each
// capability; today it creates a pool region, joins it as a node and publishes a named object.
#include <unistd.h>

#include <cstring>
#include <memory>
#include <string>

#include "commands.h"
#include "util/units.h"

namespace cxlkv::cli {

void AddDemoCommands(CLI::App& app, CommandResult& result) {
  struct Args {
    std::string path;
    std::string size = "256M";
  };
  auto args = std::make_shared<Args>();
  args->path = "/dev/shm/cxlkv-demo-" + std::to_string(::getuid());
  CLI::App* cmd = app.add_subcommand("demo", "Run the end-to-end demo on a region in /dev/shm");
  cmd->add_option("--path", args->path, "Region path (re-created)")->capture_default_str();
  cmd->add_option("--size", args->size, "Region size")->capture_default_str();
  cmd->callback([args, &result] {
    auto size = util::ParseByteSize(args->size);
    if (!size.ok()) {
      result.status = size.status();
      return;
    }
    PoolCreateOptions opts;
    opts.size = *size;
    opts.overwrite = true;
    result.status = Pool::Create({args->path}, opts);
    if (!result.status.ok()) return;
    auto attached = Region::Attach(args->path);
    if (!attached.ok()) {
      result.status = attached.status();
      return;
    }
    std::printf("== demo: created a pool region at %s ==\n", args->path.c_str());
    PrintRegionInfo((*attached)->info(), stdout);
    PoolOpenOptions open;
    open.node_id = 0;
    auto pool = Pool::Open({args->path}, open);
    if (!pool.ok()) {
      result.status = pool.status();
      return;
    }
    // Publish one object by name, as a prefill node would publish a KV block table.
    const std::string message = "hello from node 0 through shared memory";
    auto off = (*pool)->Alloc(message.size());
    if (!off.ok()) {
      result.status = off.status();
      return;
    }
    std::memcpy((*pool)->Ptr(*off, message.size()), message.data(), message.size());
    result.status = (*pool)->Put("demo/greeting", *off, message.size());
    if (!result.status.ok()) return;
    auto root = (*pool)->Get("demo/greeting");
    if (!root.ok()) {
      result.status = root.status();
      return;
    }
    std::printf("== joined as node 0, published root 'demo/greeting' at offset %s: \"%.*s\" ==\n",
                util::Hex64(root->offset).c_str(), static_cast<int>(root->size),
                reinterpret_cast<const char*>((*pool)->Ptr(root->offset, root->size)));
  });
}

}  // namespace cxlkv::cli
