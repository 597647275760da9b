// cxlkv._cxlkv: the Python module's native core (pybind11). Private: python/cxlkv/ wraps it,
// checks tensors and buffers (shape, dtype, contiguity, device) and hands this module their
// addresses, so the bytes move exactly once — by the transfer itself — and torch is never
// linked here (any torch build the interpreter has works).
//
// Errors: every cxlkv Status becomes an exception of cxlkv's own hierarchy (cxlkv.Error and a
// subclass per status code, created here), carrying the core's message. Copies and index
// operations run with the GIL released; close() waits for them (a reader-writer lock).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <cstring>
#include <memory>
#include <shared_mutex>
#include <string>
#include <vector>

#include "cxlkv/cache.h"
#include "cxlkv/kv_store.h"
#include "cxlkv/layout.h"
#include "cxlkv/pool.h"
#include "pool/pool_internal.h"

namespace py = pybind11;

namespace cxlkv::python {
namespace {

constexpr size_t kCodes = static_cast<size_t>(StatusCode::kUnavailable) + 1;
std::array<PyObject*, kCodes> error_types{};

// A failed Status on its way to Python (translated in the module's exception translator).
struct StatusError : std::exception {
  StatusCode code;
  std::string message;
  StatusError(StatusCode c, std::string m) : code(c), message(std::move(m)) {}
  const char* what() const noexcept override { return message.c_str(); }
};

[[noreturn]] void Raise(const Status& s) { throw StatusError(s.code(), s.ToString()); }
void Check(const Status& s) {
  if (!s.ok()) Raise(s);
}
template <class T>
T Take(Result<T> r) {
  if (!r.ok()) Raise(r.status());
  return std::move(*r);
}

// Keys travel as C-contiguous uint64 arrays of shape (n, 2): [lo, hi] per key.
using KeyArray = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>;

std::span<const BlockKey> KeysOf(const KeyArray& a) {
  if (a.ndim() != 2 || a.shape(1) != 2) {
    Raise(InvalidArgument("keys must be a uint64 array of shape (n, 2), got " + std::to_string(a.ndim()) +
                          " dimensions: make them with Namespace.chain_keys or Namespace.keys_from_hashes"));
  }
  static_assert(sizeof(BlockKey) == 16);
  return {reinterpret_cast<const BlockKey*>(a.data()), static_cast<size_t>(a.shape(0))};
}

KeyArray MakeKeys(const std::vector<BlockKey>& keys) {
  KeyArray out({static_cast<py::ssize_t>(keys.size()), py::ssize_t{2}});
  if (!keys.empty()) std::memcpy(out.mutable_data(), keys.data(), keys.size() * sizeof(BlockKey));
  return out;
}

// One pool opened by this process; shared by the namespaces and stores made from it so that
// close() can end it while they still exist (they then raise).
struct PoolState {
  std::unique_ptr<Pool> pool;
  KvCache* cache = nullptr;
  std::shared_mutex mu;  // shared: an operation; exclusive: close

  // Holds the pool open for one operation (the GIL released), or raises if it is closed.
  class Use {
   public:
    explicit Use(PoolState& s) : lock_(s.mu) {
      if (!s.pool) Raise(InvalidArgument("the pool is closed: open it again with cxlkv.Pool(...)"));
      cache = s.cache;
    }
    KvCache* cache = nullptr;

   private:
    std::shared_lock<std::shared_mutex> lock_;
  };
};

struct PyNamespace {
  std::shared_ptr<PoolState> state;
  NamespaceHandle handle;
  KvLayoutSignature layout;
};

struct PyKvLoad;
struct PyKvSave;

struct PyKvStore {
  std::shared_ptr<PoolState> state;
  std::unique_ptr<EngineKvStore> store;  // reset on close(), under the pool's exclusive lock
  // Layer-wise operations in flight: close() ends them before their store.
  std::vector<std::weak_ptr<PyKvLoad>> loads;
  std::vector<std::weak_ptr<PyKvSave>> saves;
};

// A layer-wise load or save; `op` is reset when it ends (or its pool closes).
struct PyKvLoad {
  std::shared_ptr<PyKvStore> store;
  std::unique_ptr<EngineKvLoad> op;
  size_t blocks = 0;
};
struct PyKvSave {
  std::shared_ptr<PyKvStore> store;
  std::unique_ptr<EngineKvSave> op;
};

// Drops expired handles so a long-lived store's lists stay short.
template <class T>
void Prune(std::vector<std::weak_ptr<T>>& v) {
  std::erase_if(v, [](const std::weak_ptr<T>& w) { return w.expired(); });
}

class PyPool {
 public:
  PyPool(const std::vector<std::string>& paths, uint32_t node_id, uint32_t lease_ms, bool recovers)
      : state_(std::make_shared<PoolState>()) {
    PoolOpenOptions o;
    o.node_id = node_id;
    o.lease_ms = lease_ms;
    o.recovers = recovers;
    Result<std::unique_ptr<Pool>> opened = [&] {
      py::gil_scoped_release nogil;
      return Pool::Open(paths, o);
    }();
    std::unique_ptr<Pool> pool = Take(std::move(opened));
    auto cache = pool->Cache();
    if (!cache.ok()) Raise(cache.status());
    state_->cache = *cache;
    state_->pool = std::move(pool);
  }

  void Close() {
    py::gil_scoped_release nogil;
    std::unique_lock<std::shared_mutex> lock(state_->mu);
    for (auto& weak : stores_) {
      auto s = weak.lock();
      if (!s) continue;
      for (auto& l : s->loads) {
        if (auto h = l.lock()) h->op.reset();  // waits for the copy, releases the pins
      }
      for (auto& v : s->saves) {
        if (auto h = v.lock()) h->op.reset();  // aborts: nothing published
      }
      s->store.reset();
    }
    state_->cache = nullptr;
    state_->pool.reset();
  }
  bool closed() {
    std::shared_lock<std::shared_mutex> lock(state_->mu);
    return state_->pool == nullptr;
  }

  PyNamespace Namespace(const std::string& model, const std::string& extra, const KvLayoutSignature& layout) {
    PoolState::Use use(*state_);
    KeyNamespace ns{model, layout, extra};
    return PyNamespace{state_, Take(use.cache->Namespace(ns)), layout};
  }

  size_t Exists(const PyNamespace& ns, const KeyArray& keys) {
    auto k = KeysOf(keys);
    py::gil_scoped_release nogil;
    PoolState::Use use(*state_);
    return Take(use.cache->Exists(ns.handle, k));
  }

  // Whole blocks from raw buffers (SGLang's per-page host tensors): reserve all, copy, commit.
  // Keys already cached (or being written elsewhere) are skipped. Returns (written, skipped).
  std::pair<uint64_t, uint64_t> PutBuffers(const PyNamespace& ns, const KeyArray& keys,
                                           const std::vector<uintptr_t>& ptrs, uint64_t bytes) {
    auto k = KeysOf(keys);
    if (ptrs.size() != k.size()) {
      Raise(InvalidArgument("put: " + std::to_string(k.size()) + " keys but " + std::to_string(ptrs.size()) +
                            " values: give one value per key"));
    }
    if (k.empty()) return {0, 0};
    py::gil_scoped_release nogil;
    PoolState::Use use(*state_);
    if (k.size() == 1) {  // one block: the single-key path (no batch bookkeeping)
      Status s = use.cache->Put(ns.handle, k[0], reinterpret_cast<const void*>(ptrs[0]), bytes);
      if (s.ok()) return {1, 0};
      if (s.code() == StatusCode::kAlreadyExists || s.code() == StatusCode::kBusy) return {0, 1};
      Raise(s);
    }
    auto many = Take(use.cache->ReserveMany(ns.handle, k, bytes));
    std::vector<Reservation> open;
    uint64_t skipped = 0;
    Status first;
    for (size_t i = 0; i < many.size(); ++i) {
      if (many[i].outcome == ReserveOutcome::kReserved) {
        Status w = use.cache->Write(many[i].reservation, 0, reinterpret_cast<const void*>(ptrs[i]), bytes);
        if (!w.ok() && first.ok()) first = w;
        open.push_back(many[i].reservation);
      } else if (many[i].outcome == ReserveOutcome::kAlreadyCached || many[i].outcome == ReserveOutcome::kBusy) {
        ++skipped;
      } else if (first.ok()) {
        first = many[i].status;
      }
    }
    if (!first.ok()) {
      (void)use.cache->AbortMany(open);  // nothing of a failed batch is published
      Raise(first);
    }
    Check(use.cache->CommitMany(open));
    return {open.size(), skipped};
  }

  // The longest cached prefix of `keys` read whole into the buffers; returns its length.
  size_t GetBuffers(const PyNamespace& ns, const KeyArray& keys, const std::vector<uintptr_t>& ptrs,
                    uint64_t bytes) {
    auto k = KeysOf(keys);
    if (ptrs.size() != k.size()) {
      Raise(InvalidArgument("get: " + std::to_string(k.size()) + " keys but " + std::to_string(ptrs.size()) +
                            " destinations: give one per key"));
    }
    if (k.empty()) return 0;
    py::gil_scoped_release nogil;
    PoolState::Use use(*state_);
    LookupResult hit = Take(use.cache->Lookup(ns.handle, k));
    Status s;
    size_t i = 0;
    for (; i < hit.pins.size() && s.ok(); ++i) {
      if (hit.pins[i].bytes != bytes) {
        s = InvalidArgument("get: block " + std::to_string(i) + " holds " + std::to_string(hit.pins[i].bytes) +
                            " bytes, the destination " + std::to_string(bytes) + ": this namespace's blocks are " +
                            std::to_string(ns.handle.block_bytes) + " bytes");
        break;
      }
      s = use.cache->Read(hit.pins[i], 0, reinterpret_cast<void*>(ptrs[i]), bytes);
    }
    use.cache->Release(hit.pins);
    Check(s);
    return hit.pins.size();
  }

  uint64_t EvictAll() {
    py::gil_scoped_release nogil;
    PoolState::Use use(*state_);
    return Take(use.cache->EvictAll());
  }

  uint64_t EvictNamespace(const PyNamespace& ns) {
    py::gil_scoped_release nogil;
    PoolState::Use use(*state_);
    return Take(use.cache->EvictNamespace(ns.handle));
  }

  // `cuda_device` < 0: the layers are host memory; otherwise device pointers of that GPU.
  std::shared_ptr<PyKvStore> Register(const PyNamespace& ns, const EngineKvLayout& layout, uint32_t threads,
                                      int cuda_device) {
    PoolState::Use use(*state_);
    auto store = std::make_shared<PyKvStore>();
    store->state = state_;
    if (cuda_device < 0) {
      store->store = Take(EngineKvStore::Register(*use.cache, ns.handle, layout, threads));
    } else {
      py::gil_scoped_release nogil;  // registering the pool's memory with the GPU takes a while
      store->store = Take(EngineKvStore::RegisterDevice(*state_->pool, ns.handle, layout, cuda_device));
    }
    std::erase_if(stores_, [](const std::weak_ptr<PyKvStore>& w) { return w.expired(); });
    stores_.push_back(store);
    return store;
  }

 private:
  std::shared_ptr<PoolState> state_;
  std::vector<std::weak_ptr<PyKvStore>> stores_;
};

// A registered store's call, with the pool held open and the store still registered.
template <class Fn>
auto WithStore(PyKvStore& s, Fn fn) {
  py::gil_scoped_release nogil;
  PoolState::Use use(*s.state);
  if (!s.store) Raise(InvalidArgument("this KV store was closed with its pool"));
  return fn(*s.store);
}

void RegisterErrors(py::module_& m) {
  PyObject* base = PyErr_NewExceptionWithDoc("cxlkv.Error", "A cxlkv operation failed; .args[0] says why and what to do.",
                                             PyExc_Exception, nullptr);
  m.add_object("Error", py::reinterpret_steal<py::object>(base));
  struct Kind {
    StatusCode code;
    const char* name;
    PyObject* also;  // a builtin it also is, or null
  };
  const Kind kinds[] = {
      {StatusCode::kInvalidArgument, "InvalidArgumentError", PyExc_ValueError},
      {StatusCode::kNotFound, "NotFoundError", PyExc_LookupError},
      {StatusCode::kAlreadyExists, "AlreadyExistsError", nullptr},
      {StatusCode::kCorrupted, "CorruptedError", nullptr},
      {StatusCode::kVersionMismatch, "VersionMismatchError", nullptr},
      {StatusCode::kNoSpace, "NoSpaceError", nullptr},
      {StatusCode::kPermissionDenied, "PermissionDeniedError", PyExc_PermissionError},
      {StatusCode::kIoError, "IoError", PyExc_OSError},
      {StatusCode::kBusy, "BusyError", nullptr},
      {StatusCode::kTimeout, "TimeoutError", PyExc_TimeoutError},
      {StatusCode::kNotSupported, "NotSupportedError", nullptr},
      {StatusCode::kInternal, "InternalError", nullptr},
      {StatusCode::kLeaseExpired, "LeaseExpiredError", nullptr},
      {StatusCode::kUnavailable, "UnavailableError", nullptr},
  };
  error_types.fill(base);
  for (const Kind& k : kinds) {
    py::tuple bases = k.also ? py::make_tuple(py::handle(base), py::handle(k.also)) : py::make_tuple(py::handle(base));
    const std::string qual = std::string("cxlkv.") + k.name;
    PyObject* t = PyErr_NewException(qual.c_str(), bases.ptr(), nullptr);
    m.add_object(k.name, py::reinterpret_steal<py::object>(t));
    error_types[static_cast<size_t>(k.code)] = t;
  }
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusError& e) {
      const auto i = static_cast<size_t>(e.code);
      PyErr_SetString(i < kCodes ? error_types[i] : error_types[0], e.message.c_str());
    }
  });
}

}  // namespace

PYBIND11_MODULE(_cxlkv, m) {
  m.doc() = "cxlkv's native core (private: use the cxlkv package).";
  RegisterErrors(m);

  m.def(
      "create_pool",
      [](const std::vector<std::string>& paths, uint64_t size, uint32_t max_nodes, bool overwrite, bool checksum,
         uint64_t index_entries, uint64_t cache_capacity) {
        PoolCreateOptions o;
        o.size = size;
        o.max_nodes = max_nodes;
        o.overwrite = overwrite;
        o.checksum = checksum;
        o.index_entries = index_entries;
        o.cache_capacity = cache_capacity;
        py::gil_scoped_release nogil;
        Check(Pool::Create(paths, o));
      },
      py::arg("paths"), py::arg("size"), py::arg("max_nodes"), py::arg("overwrite"), py::arg("checksum"),
      py::arg("index_entries"), py::arg("cache_capacity"));

  m.def("cuda_built", &EngineKvStore::DeviceBuilt,
        "Whether this build has the CUDA transfer path (device tensors can be registered where a GPU is).");

  m.def(
      "stat",
      [](const std::vector<std::string>& paths, uint32_t watch_ms) {
        py::gil_scoped_release nogil;
        auto regions = Take(pool::AttachAll(paths));
        return pool::Stat(regions, watch_ms).dump();
      },
      py::arg("paths"), py::arg("watch_ms"));

  py::class_<KvLayoutSignature>(m, "_Layout")
      .def(py::init([](uint32_t dtype, uint32_t layers, uint32_t heads, uint32_t head_size, uint32_t block_size,
                       uint32_t tp_rank, uint32_t tp_size, uint32_t pp_stage, uint32_t kv_parts,
                       uint32_t block_format) {
             if (dtype > static_cast<uint32_t>(KvDtype::kFp32)) Raise(InvalidArgument("dtype code out of range"));
             KvLayoutSignature s;
             s.dtype = static_cast<KvDtype>(dtype);
             s.num_layers = layers;
             s.num_kv_heads = heads;
             s.head_size = head_size;
             s.block_size = block_size;
             s.tp_rank = tp_rank;
             s.tp_size = tp_size;
             s.pp_stage = pp_stage;
             s.kv_parts = kv_parts;
             s.block_format = block_format;  // checked where the namespace is registered
             return s;
           }),
           py::arg("dtype"), py::arg("num_layers"), py::arg("num_kv_heads"), py::arg("head_size"),
           py::arg("block_size"), py::arg("tp_rank"), py::arg("tp_size"), py::arg("pp_stage"), py::arg("kv_parts"),
           py::arg("block_format") = kPoolBlockFormat)
      .def_property_readonly("block_bytes", &KvLayoutSignature::BlockBytes);

  py::class_<PyNamespace>(m, "_Namespace")
      .def_property_readonly("id", [](const PyNamespace& n) { return n.handle.id; })
      .def_property_readonly("block_size", [](const PyNamespace& n) { return n.handle.block_size; })
      .def_property_readonly("block_bytes", [](const PyNamespace& n) { return n.handle.block_bytes; })
      .def("chain_keys",
           [](const PyNamespace& n, const py::array_t<int32_t, py::array::c_style | py::array::forcecast>& tokens) {
             if (tokens.ndim() != 1) Raise(InvalidArgument("tokens must be one-dimensional"));
             return MakeKeys(KvCache::ChainKeys(
                 n.handle, std::span<const int32_t>(tokens.data(), static_cast<size_t>(tokens.shape(0)))));
           })
      .def("keys_from_hashes", [](const PyNamespace& n, const std::vector<py::bytes>& hashes) {
        std::vector<BlockKey> keys;
        keys.reserve(hashes.size());
        for (const py::bytes& h : hashes) {
          std::string_view v = h;
          if (v.empty()) Raise(InvalidArgument("an engine block hash is empty"));
          keys.push_back(KvCache::KeyFromEngineHash(
              n.handle, std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(v.data()), v.size())));
        }
        return MakeKeys(keys);
      });

  py::class_<PyKvStore, std::shared_ptr<PyKvStore>>(m, "_KvStore")
      .def("exists_prefix",
           [](PyKvStore& s, const KeyArray& keys) {
             auto k = KeysOf(keys);
             return WithStore(s, [&](EngineKvStore& st) { return Take(st.ExistsPrefix(k)); });
           })
      .def("assign_blocks",
           [](PyKvStore& s, BlockOwner owner, const std::vector<uint32_t>& ids) {
             WithStore(s, [&](EngineKvStore& st) { Check(st.AssignBlocks(owner, ids)); });
           })
      .def("release_blocks",
           [](PyKvStore& s, BlockOwner owner, const std::vector<uint32_t>& ids) {
             return WithStore(s, [&](EngineKvStore& st) { return st.ReleaseBlocks(owner, ids); });
           })
      .def("release_owner",
           [](PyKvStore& s, BlockOwner owner) {
             return WithStore(s, [&](EngineKvStore& st) { return st.ReleaseOwner(owner); });
           })
      .def("put_many",
           [](PyKvStore& s, const KeyArray& keys, const std::vector<uint32_t>& ids, BlockOwner owner) {
             auto k = KeysOf(keys);
             auto r = WithStore(s, [&](EngineKvStore& st) { return Take(st.PutMany(k, ids, owner)); });
             return std::make_pair(r.written, r.skipped);
           }, py::arg("keys"), py::arg("ids"), py::arg("owner") = kAnyOwner)
      .def("get_many_into",
           [](PyKvStore& s, const KeyArray& keys, const std::vector<uint32_t>& ids, BlockOwner owner) {
             auto k = KeysOf(keys);
             return WithStore(s, [&](EngineKvStore& st) { return Take(st.GetManyInto(k, ids, owner)); });
           }, py::arg("keys"), py::arg("ids"), py::arg("owner") = kAnyOwner)
      .def("start_get_many_into",
           [](const std::shared_ptr<PyKvStore>& s, const KeyArray& keys, const std::vector<uint32_t>& ids,
              BlockOwner owner) {
             auto k = KeysOf(keys);
             auto h = std::make_shared<PyKvLoad>();
             h->store = s;
             h->op = WithStore(*s, [&](EngineKvStore& st) { return Take(st.StartGetManyInto(k, ids, owner)); });
             h->blocks = h->op->blocks();
             Prune(s->loads);
             s->loads.push_back(h);
             return h;
           }, py::arg("keys"), py::arg("ids"), py::arg("owner") = kAnyOwner)
      .def("start_put_many",
           [](const std::shared_ptr<PyKvStore>& s, const KeyArray& keys, const std::vector<uint32_t>& ids,
              BlockOwner owner) {
             auto k = KeysOf(keys);
             auto h = std::make_shared<PyKvSave>();
             h->store = s;
             h->op = WithStore(*s, [&](EngineKvStore& st) { return Take(st.StartPutMany(k, ids, owner)); });
             Prune(s->saves);
             s->saves.push_back(h);
             return h;
           }, py::arg("keys"), py::arg("ids"), py::arg("owner") = kAnyOwner);

  py::class_<PyKvLoad, std::shared_ptr<PyKvLoad>>(m, "_KvLoad")
      .def_property_readonly("blocks", [](const PyKvLoad& l) { return l.blocks; })
      .def("wait_layer",
           [](PyKvLoad& l, uint32_t layer) {
             py::gil_scoped_release nogil;
             PoolState::Use use(*l.store->state);
             if (l.op) l.op->WaitLayer(layer);
           })
      .def("close", [](PyKvLoad& l) {
        py::gil_scoped_release nogil;
        std::shared_lock<std::shared_mutex> lock(l.store->state->mu);  // a closed pool ended it already
        l.op.reset();  // waits for the copy, releases the pins
      });

  py::class_<PyKvSave, std::shared_ptr<PyKvSave>>(m, "_KvSave")
      .def("layer_computed",
           [](PyKvSave& v, uint32_t layer) {
             py::gil_scoped_release nogil;
             PoolState::Use use(*v.store->state);
             if (!v.op) Raise(InvalidArgument("this save has ended (finished, aborted, or its pool closed)"));
             Check(v.op->LayerComputed(layer));
           })
      .def("finish",
           [](PyKvSave& v) {
             py::gil_scoped_release nogil;
             PoolState::Use use(*v.store->state);
             if (!v.op) Raise(InvalidArgument("this save has ended (finished, aborted, or its pool closed)"));
             auto r = v.op->Finish();
             v.op.reset();
             auto done = Take(std::move(r));
             return std::make_pair(done.written, done.skipped);
           })
      .def("abort", [](PyKvSave& v) {
        py::gil_scoped_release nogil;
        std::shared_lock<std::shared_mutex> lock(v.store->state->mu);  // a closed pool ended it already
        v.op.reset();  // nothing published
      });

  py::class_<PyPool>(m, "_Pool")
      .def(py::init<const std::vector<std::string>&, uint32_t, uint32_t, bool>(), py::arg("paths"),
           py::arg("node_id"), py::arg("lease_ms"), py::arg("recovers"))
      .def("close", &PyPool::Close)
      .def_property_readonly("closed", &PyPool::closed)
      .def("namespace", &PyPool::Namespace)
      .def("exists", &PyPool::Exists)
      .def("put_buffers", &PyPool::PutBuffers)
      .def("get_buffers", &PyPool::GetBuffers)
      .def("evict_all", &PyPool::EvictAll)
      .def("evict_namespace", &PyPool::EvictNamespace)
      .def("register",
           [](PyPool& p, const PyNamespace& ns, uint32_t kind, uint32_t dtype, uint32_t num_blocks,
              uint32_t block_size, uint32_t heads, uint32_t head_size, uint32_t latent_dim, uint32_t tp_rank,
              uint32_t tp_size, uint32_t pp_stage, const std::vector<uintptr_t>& layers, uint32_t threads,
              int cuda_device) {
             if (kind > static_cast<uint32_t>(EngineLayoutKind::kFlashInferHnd) || dtype > 3) {
               Raise(InvalidArgument("layout kind or dtype code out of range"));
             }
             EngineKvLayout l;
             l.kind = static_cast<EngineLayoutKind>(kind);
             l.dtype = static_cast<KvDtype>(dtype);
             l.num_blocks = num_blocks;
             l.block_size = block_size;
             l.num_kv_heads = heads;
             l.head_size = head_size;
             l.latent_dim = latent_dim;
             l.tp_rank = tp_rank;
             l.tp_size = tp_size;
             l.pp_stage = pp_stage;
             for (uintptr_t a : layers) l.layers.push_back(reinterpret_cast<uint8_t*>(a));
             return p.Register(ns, l, threads, cuda_device);
           });
}

}  // namespace cxlkv::python
