// The CUDA handler of fused_moe: executes a launch program of Triton kernels
// compiled ahead of time (jax_nbx/triton/plan.py builds the program,
// jax_nbx/triton/compile.py the cubins) on XLA's stream.
//
// Per call: reserve the workspace in the account ("cuda:N"); the workspace
// itself is a second output buffer that XLA allocates in its own pool and the
// caller discards (XLA's FFI ScratchAllocator refused even 2.6 kB on jax
// 0.11.2 on an H200, 2026-11-29); look up the pointer tables (one int64 address per
// expert and projection, cached under a fingerprint of every address); load
// each cubin once per device (cached by content hash); launch every kernel in
// order, checking each driver call; read back the bad-expert-id word and fail
// the call naming the slot and the id when there is one.
//
// The driver API is reached through dlopen("libcuda.so.1"), so the extension
// imports on machines without a GPU driver; the handler reports the missing
// driver as an error if it is ever called there.
#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <cuda.h>
#include <cuda_runtime_api.h>  // cudaStream_t (XLA's stream type); no runtime calls

#include "abi.h"
#include "account.h"
#include "cuda/moe_cuda.h"
#include "cuda/program.h"
#include "lru.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace nbx {
namespace {

#define NBX_STR2(x) #x
#define NBX_STR(x) NBX_STR2(x)

// Driver entry points, by their versioned symbol names (cuda.h maps e.g.
// cuMemAlloc to cuMemAlloc_v2; NBX_STR expands the macro first).
struct Driver {
  bool ok = false;
  std::string why;
#define NBX_DRIVER_FNS(X)                                                             \
  X(cuInit) X(cuGetErrorString) X(cuDeviceGet) X(cuDevicePrimaryCtxRetain)            \
  X(cuCtxPushCurrent) X(cuCtxPopCurrent) X(cuModuleLoadData) X(cuModuleGetFunction)   \
  X(cuFuncSetAttribute) X(cuLaunchKernel) X(cuMemAlloc) X(cuMemFree) X(cuMemcpyHtoD)  \
  X(cuMemcpyDtoHAsync) X(cuStreamSynchronize) X(cuMemAllocHost) X(cuEventCreate)        \
  X(cuEventRecord) X(cuEventQuery) X(cuEventSynchronize) X(cuMemcpyHtoDAsync)         \
  X(cuMemFreeHost)
// CUDA graphs (JAX_NBX_CUDA_GRAPHS): optional, so a driver without them
// still runs the plain launches; `graphs_why` says what is missing.
#define NBX_GRAPH_FNS(X)                                                              \
  X(cuGraphCreate) X(cuGraphDestroy) X(cuGraphAddKernelNode) X(cuGraphInstantiate)    \
  X(cuGraphExecKernelNodeSetParams) X(cuGraphLaunch) X(cuGraphExecDestroy)
#define NBX_DECLARE(fn) decltype(&::fn) fn = nullptr;
  NBX_DRIVER_FNS(NBX_DECLARE)
  NBX_GRAPH_FNS(NBX_DECLARE)
#undef NBX_DECLARE
  std::string graphs_why;

  static Driver& Get() {
    static Driver d = Load();
    return d;
  }

 private:
  static Driver Load() {
    Driver d;
    void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) {
      d.why = std::string("cannot load the CUDA driver (libcuda.so.1): ") + dlerror();
      return d;
    }
#define NBX_LOAD(fn)                                                                 \
  d.fn = reinterpret_cast<decltype(&::fn)>(dlsym(h, NBX_STR(fn)));                   \
  if (d.fn == nullptr) {                                                             \
    d.why = "the CUDA driver lacks " NBX_STR(fn);                                    \
    return d;                                                                        \
  }
    NBX_DRIVER_FNS(NBX_LOAD)
#undef NBX_LOAD
#define NBX_LOAD_OPTIONAL(fn)                                                        \
  d.fn = reinterpret_cast<decltype(&::fn)>(dlsym(h, NBX_STR(fn)));                   \
  if (d.fn == nullptr && d.graphs_why.empty())                                       \
    d.graphs_why = "the CUDA driver lacks " NBX_STR(fn) " (JAX_NBX_CUDA_GRAPHS needs it)";
    NBX_GRAPH_FNS(NBX_LOAD_OPTIONAL)
#undef NBX_LOAD_OPTIONAL
    CUresult r = d.cuInit(0);
    if (r != CUDA_SUCCESS) {
      d.why = "cuInit failed with CUresult " + std::to_string(static_cast<int>(r));
      return d;
    }
    d.ok = true;
    return d;
  }
};

ffi::Error CudaError(const char* what, CUresult r) {
  const char* s = nullptr;
  Driver& d = Driver::Get();
  if (d.cuGetErrorString) d.cuGetErrorString(r, &s);
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string(what) + " failed: " + (s ? s : "unknown CUDA error") +
                        " (CUresult " + std::to_string(static_cast<int>(r)) + ")");
}

#define NBX_CU(what, call)                                       \
  do {                                                           \
    CUresult _r = (call);                                        \
    if (_r != CUDA_SUCCESS) return CudaError(what, _r);          \
  } while (0)

// Pushes the device's primary context (the one XLA uses) for the scope.
class ScopedContext {
 public:
  ffi::Error Enter(int ordinal) {
    Driver& d = Driver::Get();
    static std::mutex mu;
    static std::unordered_map<int, CUcontext> contexts;
    CUcontext ctx;
    {
      std::lock_guard<std::mutex> lock(mu);
      auto it = contexts.find(ordinal);
      if (it == contexts.end()) {
        CUdevice dev;
        NBX_CU("cuDeviceGet", d.cuDeviceGet(&dev, ordinal));
        NBX_CU("cuDevicePrimaryCtxRetain", d.cuDevicePrimaryCtxRetain(&ctx, dev));
        contexts[ordinal] = ctx;
      } else {
        ctx = it->second;
      }
    }
    NBX_CU("cuCtxPushCurrent", d.cuCtxPushCurrent(ctx));
    pushed_ = true;
    return ffi::Error::Success();
  }
  ~ScopedContext() {
    if (pushed_) {
      CUcontext c;
      Driver::Get().cuCtxPopCurrent(&c);
    }
  }

 private:
  bool pushed_ = false;
};

struct LoadedKernel {
  CUfunction fn = nullptr;
  int num_warps = 4;
  int shared = 0;
};

// Cubins loaded per (device, content hash); modules live for the process.
// `row` was checked against the blob by DecodeKernelTable (cuda/program.h).
ffi::Error GetKernel(int ordinal, const uint8_t* blob, const KernelRow& row, LoadedKernel* out) {
  static std::mutex mu;
  static std::unordered_map<std::string, LoadedKernel> cache;
  const std::string name(reinterpret_cast<const char*>(blob + row.name_off),
                         static_cast<size_t>(row.name_len));
  const std::string key = std::to_string(ordinal) + ":" + std::to_string(row.hash) + ":" + name;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it != cache.end()) {
    *out = it->second;
    return ffi::Error::Success();
  }
  Driver& d = Driver::Get();
  // cuModuleLoadData wants the image in host memory that stays valid for the
  // call only; copy it so the image is suitably aligned.
  std::vector<uint64_t> image((row.cubin_len + 7) / 8 + 1, 0);
  std::memcpy(image.data(), blob + row.cubin_off, static_cast<size_t>(row.cubin_len));
  CUmodule mod;
  NBX_CU("cuModuleLoadData", d.cuModuleLoadData(&mod, image.data()));
  LoadedKernel k;
  NBX_CU("cuModuleGetFunction", d.cuModuleGetFunction(&k.fn, mod, name.c_str()));
  k.num_warps = static_cast<int>(row.num_warps);
  k.shared = static_cast<int>(row.shared);
  if (k.shared > 48 * 1024)
    NBX_CU("cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)",
           d.cuFuncSetAttribute(k.fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, k.shared));
  cache[key] = k;
  *out = k;
  return ffi::Error::Success();
}

// ---------------------------------------------------------------- pointer tables

// One device table per distinct set of expert addresses: [3][E] int64 (gate,
// up, down), in the fingerprinted LRU the Metal tables use too (lru.h); each
// table's bytes are counted in the account (tag "tables") and returned when
// its last holder drops it (evicted, and no call using it any more).
struct CudaTable {
  int ordinal = 0;
  CUdeviceptr ptr = 0;
  int64_t bytes = 0;
  CudaTable() = default;
  CudaTable(const CudaTable&) = delete;
  CudaTable& operator=(const CudaTable&) = delete;
  ~CudaTable() {
    if (ptr == 0) return;
    ScopedContext ctx;
    if (!ctx.Enter(ordinal).failure()) Driver::Get().cuMemFree(ptr);
    Account::Get().Release(Device{"cuda", ordinal}, bytes, "tables", nullptr);
  }
};

class TableCache {
 public:
  static TableCache& Get() {
    static TableCache c;
    return c;
  }

  // The table of `addrs` on dev; *out keeps it alive while the call uses it.
  ffi::Error Lookup(const Device& dev, const std::vector<int64_t>& addrs,
                    std::shared_ptr<CudaTable>* out) {
    std::vector<int64_t> key;
    key.reserve(addrs.size() + 1);
    key.push_back(dev.ordinal);
    key.insert(key.end(), addrs.begin(), addrs.end());
    std::lock_guard<std::mutex> lock(mu_);
    if ((*out = lru_.Find(key))) return ffi::Error::Success();
    const int64_t bytes = static_cast<int64_t>(addrs.size() * sizeof(int64_t));
    std::string err;
    void* unused = nullptr;
    if (!Account::Get().Reserve(dev, bytes, "tables", WorkShape{}, &err, &unused))
      return ffi::Error(ffi::ErrorCode::kResourceExhausted, err);
    Driver& d = Driver::Get();
    CUdeviceptr p;
    CUresult r = d.cuMemAlloc(&p, bytes);
    if (r != CUDA_SUCCESS) {
      Account::Get().Release(dev, bytes, "tables", nullptr);
      return CudaError("pointer table allocation", r);
    }
    auto t = std::make_shared<CudaTable>();
    t->ordinal = dev.ordinal;
    t->ptr = p;
    t->bytes = bytes;  // from here the table returns its bytes when dropped
    if ((r = d.cuMemcpyHtoD(p, addrs.data(), bytes)) != CUDA_SUCCESS)
      return CudaError("pointer table upload", r);
    lru_.Insert(key, t);
    *out = std::move(t);
    return ffi::Error::Success();
  }

  void Stats(int64_t* entries, int64_t* hits, int64_t* misses, int64_t* evictions,
             int64_t* bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    *entries = static_cast<int64_t>(lru_.size());
    *hits = lru_.hits();
    *misses = lru_.misses();
    *evictions = lru_.evictions();
    int64_t b = 0;
    lru_.ForEach([&](const CudaTable& t) { b += t.bytes; });
    *bytes = b;
  }

  void SetCapacity(size_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    lru_.SetCapacity(n);
  }

  void Clear() {
    std::lock_guard<std::mutex> lock(mu_);
    lru_.Clear();
  }

 private:
  std::mutex mu_;
  FingerprintLru<CudaTable> lru_{256};
};

// ---------------------------------------------------------------- CUDA graphs

// JAX_NBX_CUDA_GRAPHS (the handlers' attribute `graph`): a program's launches
// as one CUDA graph -- a chain of kernel nodes built and instantiated on the
// first call of a program shape on a device, then per call every node's
// arguments updated (cuGraphExecKernelNodeSetParams copies them) and the graph
// launched once on XLA's stream.  A graph executable is keyed by its device
// and every launch's function, grid, block and shared memory; at most
// kGraphCacheEntries are kept (least recently used dropped: an executable
// still running is freed by the driver when it completes).  Updates and the
// launch of one executable happen under its mutex, so concurrent calls never
// interleave them; the driver orders launches of one executable.
struct CudaGraph {
  int ordinal = 0;
  CUgraph graph = nullptr;
  CUgraphExec exec = nullptr;
  std::vector<CUgraphNode> nodes;
  std::mutex mu;
  CudaGraph() = default;
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;
  ~CudaGraph() {
    Driver& d = Driver::Get();
    ScopedContext ctx;
    if (ctx.Enter(ordinal).failure()) return;
    if (exec != nullptr) d.cuGraphExecDestroy(exec);
    if (graph != nullptr) d.cuGraphDestroy(graph);
  }
};

constexpr size_t kGraphCacheEntries = 64;

// One launch of a program as the driver takes it.
struct KernelCall {
  CUfunction fn;
  unsigned grid[3];
  unsigned block;
  unsigned shared;
  void** params;
};

CUDA_KERNEL_NODE_PARAMS NodeParams(const KernelCall& c) {
  CUDA_KERNEL_NODE_PARAMS p;
  std::memset(&p, 0, sizeof p);
  p.func = c.fn;
  p.gridDimX = c.grid[0];
  p.gridDimY = c.grid[1];
  p.gridDimZ = c.grid[2];
  p.blockDimX = c.block;
  p.blockDimY = 1;
  p.blockDimZ = 1;
  p.sharedMemBytes = c.shared;
  p.kernelParams = c.params;
  return p;
}

class GraphCache {
 public:
  static GraphCache& Get() {
    static GraphCache c;
    return c;
  }

  // Runs `calls` (in order) on `stream` as the graph of their shape,
  // building it on first use.
  ffi::Error Launch(int ordinal, const std::vector<KernelCall>& calls, CUstream stream) {
    Driver& d = Driver::Get();
    if (!d.graphs_why.empty())
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition, d.graphs_why);
    if (calls.empty()) return ffi::Error::Success();
    std::vector<int64_t> key = {ordinal};
    for (const KernelCall& c : calls)
      key.insert(key.end(), {static_cast<int64_t>(reinterpret_cast<uintptr_t>(c.fn)), c.grid[0],
                             c.grid[1], c.grid[2], c.block, c.shared});
    std::shared_ptr<CudaGraph> g;
    {
      std::lock_guard<std::mutex> lock(mu_);
      g = lru_.Find(key);
    }
    if (g == nullptr) {  // built outside the cache's lock; a racing twin is harmless
      auto fresh = std::make_shared<CudaGraph>();
      fresh->ordinal = ordinal;
      NBX_CU("cuGraphCreate", d.cuGraphCreate(&fresh->graph, 0));
      for (const KernelCall& c : calls) {
        const CUDA_KERNEL_NODE_PARAMS p = NodeParams(c);
        CUgraphNode node;
        NBX_CU("cuGraphAddKernelNode",
               d.cuGraphAddKernelNode(&node, fresh->graph,
                                      fresh->nodes.empty() ? nullptr : &fresh->nodes.back(),
                                      fresh->nodes.empty() ? 0 : 1, &p));
        fresh->nodes.push_back(node);
      }
      NBX_CU("cuGraphInstantiate", d.cuGraphInstantiate(&fresh->exec, fresh->graph, 0));
      std::lock_guard<std::mutex> glock(fresh->mu);
      NBX_CU("cuGraphLaunch", d.cuGraphLaunch(fresh->exec, stream));
      std::lock_guard<std::mutex> lock(mu_);
      lru_.Insert(key, std::move(fresh));
      return ffi::Error::Success();
    }
    std::lock_guard<std::mutex> glock(g->mu);
    for (size_t i = 0; i < calls.size(); ++i) {
      const CUDA_KERNEL_NODE_PARAMS p = NodeParams(calls[i]);
      NBX_CU("cuGraphExecKernelNodeSetParams",
             d.cuGraphExecKernelNodeSetParams(g->exec, g->nodes[i], &p));
    }
    NBX_CU("cuGraphLaunch", d.cuGraphLaunch(g->exec, stream));
    return ffi::Error::Success();
  }

 private:
  std::mutex mu_;
  FingerprintLru<CudaGraph> lru_{kGraphCacheEntries};
};

// ---------------------------------------------------------------- the handler

// A weight group's name in errors: experts.gate (dense), experts.gate.q /
// .scale / .zero (quantized), experts.gate_up / experts.down (fused).
std::string GroupName(int64_t p, int64_t G, bool fused) {
  if (fused) return p == 0 ? "experts.gate_up" : "experts.down";
  const int64_t proj = p % abi::kNumProjections, part = p / abi::kNumProjections;
  std::string name = std::string("experts.") + abi::kProjectionNames[proj];
  if (G > abi::kNumProjections) name += std::string(".") + abi::kPartNames[part];
  return name;
}

// Deferred expert-id checks (abi::kIdCheckDeferred): per device, a ring of
// pinned host records.  A call copies its err words and its topk_ids (both
// at most abi::kMaxDeferredErrWords) into the next record with asynchronous
// copies on its stream and records an event -- no synchronization; every
// later call on the device first reads the records whose events have
// completed, oldest first, and fails naming the earliest bad slot it finds.
// A full ring waits for its oldest record (the only wait).  The records'
// pinned bytes are counted in the device's account ("id checks").
class DeferredChecks {
 public:
  static DeferredChecks& Get() {
    static DeferredChecks c;
    return c;
  }

  // The message of the earliest completed check that found a bad slot (""
  // if none); needs the device's context current.
  std::string Poll(const Device& dev) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = rings_.find(dev.ordinal);
    if (it == rings_.end()) return "";
    return Drain(it->second, dev, /*wait_oldest=*/false);
  }

  // Enqueues this call's check: `words` err words at `err` and the n slots'
  // ids at `ids` (n = T * k <= kMaxDeferredErrWords).  Returns an error for
  // a CUDA failure, or a found bad slot of an earlier call (a full ring).
  ffi::Error Enqueue(const Device& dev, CUstream stream, CUdeviceptr err, int64_t words,
                     CUdeviceptr ids, int64_t n, int64_t k, int64_t E) {
    std::lock_guard<std::mutex> lock(mu_);
    Ring& ring = rings_[dev.ordinal];
    Driver& d = Driver::Get();
    if (ring.host == nullptr) {
      const int64_t bytes = kSlots * kRecordInts * static_cast<int64_t>(sizeof(int32_t));
      std::string why;
      void* unused = nullptr;
      if (!Account::Get().Reserve(dev, bytes, "id checks", WorkShape{}, &why, &unused))
        return ffi::Error(ffi::ErrorCode::kResourceExhausted, why);
      void* p = nullptr;
      std::vector<CUevent> events(kSlots, nullptr);
      CUresult r = d.cuMemAllocHost(&p, bytes);
      for (size_t i = 0; r == CUDA_SUCCESS && i < events.size(); ++i)
        r = d.cuEventCreate(&events[i], CU_EVENT_DISABLE_TIMING);
      if (r != CUDA_SUCCESS) {  // nothing half-built stays behind (a few events may leak)
        if (p != nullptr) d.cuMemFreeHost(p);
        Account::Get().Release(dev, bytes, "id checks", nullptr);
        return CudaError("setting up the deferred id checks", r);
      }
      ring.events = std::move(events);
      ring.meta.assign(kSlots, Meta{});
      ring.host = static_cast<int32_t*>(p);  // last: a built ring
    }
    std::string earlier;  // a bad slot of an earlier call, found waiting for room
    if (ring.meta[ring.tail].pending) earlier = Drain(ring, dev, /*wait_oldest=*/true);
    const int64_t slot = ring.tail;
    int32_t* rec = ring.host + slot * kRecordInts;
    NBX_CU("copying the expert-id check",
           d.cuMemcpyDtoHAsync(rec, err, words * sizeof(int32_t), stream));
    if (n > 0)
      NBX_CU("copying topk_ids for the expert-id check",
             d.cuMemcpyDtoHAsync(rec + abi::kMaxDeferredErrWords, ids, n * sizeof(int32_t), stream));
    NBX_CU("cuEventRecord (deferred id check)", d.cuEventRecord(ring.events[slot], stream));
    ring.meta[slot] = Meta{true, words, n, k, E, ++ring.calls};
    ring.tail = (slot + 1) % kSlots;
    // this call's own check is recorded either way; an earlier bad slot fails it now
    return earlier.empty() ? ffi::Error::Success() : ffi::Error::InvalidArgument(earlier);
  }

 private:
  static constexpr int64_t kSlots = 64;
  static constexpr int64_t kRecordInts = 2 * abi::kMaxDeferredErrWords;  // err words, then ids
  struct Meta {
    bool pending = false;
    int64_t words = 0, n = 0, k = 1, E = 0, call = 0;
  };
  struct Ring {
    int32_t* host = nullptr;
    std::vector<CUevent> events;
    std::vector<Meta> meta;
    int64_t head = 0, tail = 0, calls = 0;
  };

  // Reads the completed records from the oldest (the oldest one at any rate
  // with wait_oldest), freeing them; the first bad slot's message, or "".
  std::string Drain(Ring& ring, const Device& dev, bool wait_oldest) {
    Driver& d = Driver::Get();
    while (ring.meta[ring.head].pending) {
      const int64_t slot = ring.head;
      CUresult r = wait_oldest ? d.cuEventSynchronize(ring.events[slot])
                               : d.cuEventQuery(ring.events[slot]);
      wait_oldest = false;
      if (r == CUDA_ERROR_NOT_READY) return "";
      Meta m = ring.meta[slot];
      ring.meta[slot].pending = false;
      ring.head = (slot + 1) % kSlots;
      if (r != CUDA_SUCCESS)
        return "the deferred expert-id check of call " + std::to_string(m.call) + " on " +
               dev.Name() + " could not be read (CUresult " +
               std::to_string(static_cast<int>(r)) + ")";
      const int32_t* rec = ring.host + slot * kRecordInts;
      int32_t bad = abi::kErrNone;
      for (int64_t i = 0; i < m.words; ++i) bad = std::min(bad, rec[i]);
      if (bad != abi::kErrNone)
        return "topk_ids[" + std::to_string(bad / m.k) + ", " + std::to_string(bad % m.k) +
               "] = " +
               (bad >= 0 && bad < m.n ? std::to_string(rec[abi::kMaxDeferredErrWords + bad])
                                      : std::string("?")) +
               " is outside [0, " + std::to_string(m.E) + ") in an earlier call (call " +
               std::to_string(m.call) + " of the fused MoE on " + dev.Name() +
               "; JAX_NBX_CUDA_CHECK_IDS=deferred reports it at the next call; that slot was "
               "skipped, not read)";
    }
    return "";
  }

  std::mutex mu_;
  std::unordered_map<int32_t, Ring> rings_;
};

// Runs the program with the pointer tables `addrs` ([n_tables][E] absolute
// addresses: the G weight groups in abi.h's order, abi::GroupIndex(part,
// projection), or gate_up, down when `fused`; the backward's then its G
// gradient groups).  `extra` holds each group's first buffer (the program's
// typed weight arguments are inputs abi::kInputGroup0 + group), then the
// biases if any (inputs abi::kInputGroup0 + G + j), then the backward's dy.
// `outputs`: the addresses the program's kOutput arguments index (y; or dx,
// d(topk_weights)).  The program and the kernel table are decoded and
// checked (cuda/program.h) before anything is reserved, uploaded or launched.
ffi::Error RunProgram(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer w,
                      ffi::Buffer<ffi::S32> ids, int64_t G, bool fused,
                      const std::vector<CUdeviceptr>& extra,
                      const std::vector<int64_t>& addrs, int64_t n_tables,
                      const std::vector<CUdeviceptr>& outputs,
                      ffi::Result<ffi::AnyBuffer> ws_buf, ffi::Span<const uint8_t> blob,
                      ffi::Span<const int64_t> kernels, ffi::Span<const int64_t> program,
                      int64_t workspace_bytes, int64_t err_offset, int64_t err_words,
                      bool w_aligned, int64_t num_experts, int64_t check_ids, bool graph) {
  Driver& d = Driver::Get();
  if (!d.ok) return ffi::Error(ffi::ErrorCode::kFailedPrecondition, d.why);
  const Device dev{"cuda", ordinal};
  const int64_t E = num_experts;
  std::vector<KernelRow> rows;
  if (std::string why = DecodeKernelTable(kernels.begin(), kernels.size(), blob.size(), &rows);
      !why.empty())
    return ffi::Error::InvalidArgument(why);
  const int64_t n_kernels = static_cast<int64_t>(rows.size());
  std::vector<LaunchRef> launches;
  if (std::string why = DecodeProgram(program.begin(), program.size(), n_kernels,
                                      abi::kInputGroup0 + static_cast<int64_t>(extra.size()),
                                      n_tables, workspace_bytes, &launches,
                                      static_cast<int64_t>(outputs.size()));
      !why.empty())
    return ffi::Error::InvalidArgument(why);
  if (static_cast<int64_t>(addrs.size()) != n_tables * E || n_tables < G)
    return ffi::Error::InvalidArgument("pointer table has " + std::to_string(addrs.size()) +
                                       " entries; expected " + std::to_string(n_tables) +
                                       " * E = " + std::to_string(n_tables * E));
  if (w_aligned)
    for (int64_t p = 0; p < G; ++p)
      for (int64_t e = 0; e < E; ++e)
        if (addrs[p * E + e] % 16 != 0) {
          return ffi::Error::InvalidArgument(
              GroupName(p, G, fused) + " expert " + std::to_string(e) +
              " starts at an address that is not 16-byte aligned, but the kernels were compiled "
              "assuming it is");
        }

  // Workspace: counted first, then taken from XLA's pool.
  std::string err;
  void* unused = nullptr;
  const int64_t T = x.dimensions().size() > 0 ? x.dimensions()[0] : 0;
  const int64_t H = x.dimensions().size() > 1 ? x.dimensions()[1] : 0;
  if (!Account::Get().Reserve(dev, workspace_bytes, "workspace", WorkShape{T, H, 0}, &err,
                              &unused))
    return ffi::Error(ffi::ErrorCode::kResourceExhausted, err);
  struct Unreserve {
    Device dev;
    int64_t bytes;
    ~Unreserve() { Account::Get().Release(dev, bytes, "workspace", nullptr); }
  } unreserve{dev, workspace_bytes};
  if (static_cast<int64_t>(ws_buf->size_bytes()) < workspace_bytes)
    return ffi::Error::InvalidArgument("workspace buffer of " + std::to_string(ws_buf->size_bytes()) +
                                       " bytes; the program needs " + std::to_string(workspace_bytes));
  const CUdeviceptr ws = reinterpret_cast<CUdeviceptr>(ws_buf->untyped_data());
  if (err_words < 1 || err_offset < 0 || err_offset + 4 * err_words > workspace_bytes)
    return ffi::Error::InvalidArgument("the expert-id check's " + std::to_string(err_words) +
                                       " words at offset " + std::to_string(err_offset) +
                                       " do not fit the workspace of " +
                                       std::to_string(workspace_bytes) + " bytes");
  if (ws % abi::kWorkspaceAlign != 0)
    return ffi::Error::InvalidArgument("workspace buffer is not " +
                                       std::to_string(abi::kWorkspaceAlign) + "-byte aligned");

  ScopedContext ctx;
  if (auto e = ctx.Enter(ordinal); e.failure()) return e;
  // Deferred id checks (small calls only: the copies are bounded): an earlier
  // call's bad slot, once its copy has landed, fails this call.
  const int64_t n_slots = static_cast<int64_t>(ids.element_count());
  const int64_t kk = ids.dimensions().size() > 1 ? ids.dimensions()[1] : 1;
  const bool deferred = check_ids == abi::kIdCheckDeferred &&
                        err_words <= abi::kMaxDeferredErrWords &&
                        n_slots <= abi::kMaxDeferredErrWords;
  if (check_ids == abi::kIdCheckDeferred)
    if (std::string bad = DeferredChecks::Get().Poll(dev); !bad.empty())
      return ffi::Error::InvalidArgument(bad);
  // The weights' G tables: cached (the weights stay put); tables G.. (the
  // backward's gradients, new buffers every call): uploaded per call.
  std::shared_ptr<CudaTable> table_ref;
  const std::vector<int64_t> weight_addrs(addrs.begin(), addrs.begin() + G * E);
  if (auto e = TableCache::Get().Lookup(dev, weight_addrs, &table_ref); e.failure()) return e;
  const CUdeviceptr table = table_ref->ptr;
  // The backward's gradient tables: at offset 0 of this call's workspace (abi.h
  // "CUDA backward"), uploaded on the call's stream before its launches.  From
  // pageable memory: the driver copies `addrs` before returning (it may wait
  // for the stream to do so, per CUDA's documented behaviour).
  const CUdeviceptr call_table = ws;
  if (n_tables > G) {
    const int64_t bytes = (n_tables - G) * E * static_cast<int64_t>(sizeof(int64_t));
    if (bytes > workspace_bytes || err_offset < bytes)
      return ffi::Error::InvalidArgument(
          "the workspace does not start with the gradients' pointer tables (" +
          std::to_string(bytes) + " bytes)");
    NBX_CU("uploading the gradients' pointer tables",
           d.cuMemcpyHtoDAsync(call_table, addrs.data() + G * E, bytes,
                               reinterpret_cast<CUstream>(stream)));
  }

  std::vector<LoadedKernel> loaded(n_kernels);
  for (int64_t i = 0; i < n_kernels; ++i)
    if (auto e = GetKernel(ordinal, blob.begin(), rows[i], &loaded[i]); e.failure())
      return e;

  // numbered as abi::kInputX, kInputW, kInputIds, then kInputGroup0 + group, then the biases
  std::vector<CUdeviceptr> inputs = {reinterpret_cast<CUdeviceptr>(x.untyped_data()),
                                     reinterpret_cast<CUdeviceptr>(w.untyped_data()),
                                     reinterpret_cast<CUdeviceptr>(ids.typed_data())};
  static_assert(abi::kInputX == 0 && abi::kInputW == 1 && abi::kInputIds == 2 &&
                    abi::kInputGroup0 == 3,
                "inputs[] is built in abi.h's input order");
  inputs.insert(inputs.end(), extra.begin(), extra.end());

  // Every index and workspace offset was checked by DecodeProgram.  The
  // argument values of every launch stay alive until the launches are made
  // (one by one, or as a graph).
  const size_t n_launches = launches.size();
  std::vector<std::vector<uint64_t>> ptr_store(n_launches);
  std::vector<std::vector<int32_t>> i32_store(n_launches);
  std::vector<std::vector<void*>> param_store(n_launches);
  std::vector<KernelCall> calls;
  static uint64_t null_scratch = 0;  // Triton's global and profile scratch: unused
  for (size_t li = 0; li < n_launches; ++li) {
    const LaunchRef& ln = launches[li];
    const size_t nargs = ln.args.size();
    std::vector<uint64_t>& ptr_vals = ptr_store[li];
    std::vector<int32_t>& i32_vals = i32_store[li];
    std::vector<void*>& params = param_store[li];
    ptr_vals.assign(nargs, 0);
    i32_vals.assign(nargs, 0);
    for (size_t a = 0; a < nargs; ++a) {
      const ArgRef& r = ln.args[a];
      switch (r.kind) {
        case abi::ArgKind::kInput: ptr_vals[a] = inputs[r.index] + r.offset; break;
        case abi::ArgKind::kOutput: ptr_vals[a] = outputs[r.index] + r.offset; break;
        case abi::ArgKind::kWorkspace: ptr_vals[a] = ws + r.offset; break;
        case abi::ArgKind::kTable:
          ptr_vals[a] = r.index < G ? table + r.index * E * sizeof(int64_t)
                                    : call_table + (r.index - G) * E * sizeof(int64_t);
          break;
        case abi::ArgKind::kI32: i32_vals[a] = static_cast<int32_t>(r.offset); break;
      }
      params.push_back(r.kind == abi::ArgKind::kI32 ? static_cast<void*>(&i32_vals[a])
                                                    : static_cast<void*>(&ptr_vals[a]));
    }
    params.push_back(&null_scratch);
    params.push_back(&null_scratch);
    const LoadedKernel& k = loaded[ln.kernel];
    const int64_t gx = ln.grid[0], gy = ln.grid[1], gz = ln.grid[2];
    if (gx * gy * gz == 0) continue;
    calls.push_back(KernelCall{k.fn,
                               {static_cast<unsigned>(gx), static_cast<unsigned>(gy),
                                static_cast<unsigned>(gz)},
                               static_cast<unsigned>(32 * k.num_warps),
                               static_cast<unsigned>(k.shared), params.data()});
  }
  if (graph) {
    if (auto e = GraphCache::Get().Launch(ordinal, calls, reinterpret_cast<CUstream>(stream));
        e.failure())
      return e;
  } else {
    for (const KernelCall& c : calls)
      NBX_CU("cuLaunchKernel",
             d.cuLaunchKernel(c.fn, c.grid[0], c.grid[1], c.grid[2], c.block, 1, 1, c.shared,
                              reinterpret_cast<CUstream>(stream), c.params, nullptr));
  }

  if (deferred) {
    return DeferredChecks::Get().Enqueue(dev, reinterpret_cast<CUstream>(stream), ws + err_offset,
                                         err_words, inputs[abi::kInputIds], n_slots, kk, E);
  }
  if (check_ids != abi::kIdCheckOff) {
    std::vector<int32_t> words(static_cast<size_t>(err_words), abi::kErrNone);
    NBX_CU("reading the expert-id check",
           d.cuMemcpyDtoHAsync(words.data(), ws + err_offset, err_words * sizeof(int32_t),
                               reinterpret_cast<CUstream>(stream)));
    NBX_CU("cuStreamSynchronize", d.cuStreamSynchronize(reinterpret_cast<CUstream>(stream)));
    int32_t bad = abi::kErrNone;
    for (int32_t v : words) bad = std::min(bad, v);
    if (bad != abi::kErrNone) {
      if (bad < 0 || bad >= n_slots)  // never from our kernels; never read out of bounds either
        return ffi::Error::Internal("the expert-id check holds slot " + std::to_string(bad) +
                                    ", outside the call's " + std::to_string(n_slots) + " slots");
      int32_t id = 0;
      NBX_CU("reading the bad expert id",
             d.cuMemcpyDtoHAsync(&id, inputs[abi::kInputIds] + static_cast<int64_t>(bad) * 4, 4,
                                 reinterpret_cast<CUstream>(stream)));
      NBX_CU("cuStreamSynchronize", d.cuStreamSynchronize(reinterpret_cast<CUstream>(stream)));
      return ffi::Error::InvalidArgument(
          "topk_ids[" + std::to_string(bad / kk) + ", " + std::to_string(bad % kk) + "] = " +
          std::to_string(id) + " is outside [0, " + std::to_string(E) + ")");
    }
  }
  return ffi::Error::Success();
}

// Stacked plain [E, ...] arrays: expert e of a projection at base + e * (bytes / E).
ffi::Error FusedMoeCudaImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                            ffi::AnyBuffer w, ffi::Buffer<ffi::S32> ids, ffi::AnyBuffer gate,
                            ffi::AnyBuffer up, ffi::AnyBuffer down, ffi::Result<ffi::AnyBuffer> y,
                            ffi::Result<ffi::AnyBuffer> ws_buf, ffi::Span<const uint8_t> blob,
                            ffi::Span<const int64_t> kernels, ffi::Span<const int64_t> program,
                            int64_t workspace_bytes, int64_t err_offset, int64_t err_words,
                            bool w_aligned, int64_t num_experts, int64_t check_ids, bool graph) {
  const int64_t E = num_experts;
  constexpr int P = abi::kNumProjections;
  const ffi::AnyBuffer* proj[P] = {&gate, &up, &down};
  std::vector<int64_t> addrs(P * E);
  std::vector<CUdeviceptr> first(P);
  for (int p = 0; p < P; ++p) {
    const int64_t stride = static_cast<int64_t>(proj[p]->size_bytes()) / (E > 0 ? E : 1);
    const int64_t base = reinterpret_cast<int64_t>(proj[p]->untyped_data());
    first[p] = static_cast<CUdeviceptr>(base);
    for (int64_t e = 0; e < E; ++e) addrs[p * E + e] = base + e * stride;
  }
  return RunProgram(stream, ordinal, x, w, ids, P, false, first, addrs, P,
                    {reinterpret_cast<CUdeviceptr>(y->untyped_data())}, ws_buf, blob, kernels,
                    program, workspace_bytes, err_offset, err_words, w_aligned, num_experts,
                    check_ids, graph);
}

// Checks abi.h's "weight views" against the weight buffers of the tables
// handler (H from x, I = `intermediate`): the views' length, gate and up
// sharing strides, quantized groups with the plain views only, every view
// inside each expert's array (`elems[g]` elements of its group g; the same
// bounds as the CPU decoder's, cpu/weights.cc).  Returns "" or what is wrong.
std::string CheckViews(ffi::Span<const int64_t> views, int64_t H, int64_t I, bool fused,
                       bool quantized, const std::vector<int64_t>& elems) {
  constexpr int F = abi::kNumViewFields, P = abi::kNumProjections;
  if (static_cast<int64_t>(views.size()) != F * P)
    return "views must hold " + std::to_string(F * P) + " values; got " +
           std::to_string(views.size());
  if (I < 1 || H < 1) return "intermediate (I) and x's H must be positive";
  const int64_t plain[F * P] = {0, I, 1, 0, I, 1, 0, H, 1};
  bool is_plain = !fused;
  for (int i = 0; i < F * P; ++i) is_plain = is_plain && views[i] == plain[i];
  if (quantized && !is_plain) return "quantized weights take the plain views only";
  if (views[1] != views[F + 1] || views[2] != views[F + 2])
    return "gate and up views must share their strides";
  if (quantized) return "";
  for (int proj = 0; proj < P; ++proj) {
    const int64_t K = proj < 2 ? H : I, N = proj < 2 ? I : H;
    const int64_t off = views[proj * F], sk = views[proj * F + 1], sn = views[proj * F + 2];
    const int64_t g = fused ? (proj == 2 ? 1 : 0) : proj;
    // int64 overflow is out of reach: each term is bounded by the buffer's elements below
    if (off < 0 || sk < 0 || sn < 0 || off >= elems[g] || (K > 1 && sk > elems[g]) ||
        (N > 1 && sn > elems[g]) || off + (K - 1) * sk + (N - 1) * sn >= elems[g])
      return std::string("the ") + abi::kProjectionNames[proj] + " view (offset " +
             std::to_string(off) + ", strides " + std::to_string(sk) + ", " + std::to_string(sn) +
             ") of a [" + std::to_string(K) + ", " + std::to_string(N) + "] matrix leaves " +
             (fused && g == 0 ? std::string("gate_up") : abi::kProjectionNames[proj]) + "'s " +
             std::to_string(elems[g]) + " elements per expert";
  }
  return "";
}

// The weights' G groups of the tables handlers (`weights` from its start:
// G groups of 1 stacked or E per-expert buffers): each expert's address per
// group (addrs [G][E]), the elements of one expert's array per group (dense
// groups; 0 for quantized ones), each group's first buffer.
ffi::Error CollectGroups(ffi::RemainingArgs weights, int64_t E, int64_t G, bool stacked,
                         bool fused_gate_up, std::vector<int64_t>* addrs,
                         std::vector<int64_t>* elems, std::vector<CUdeviceptr>* first) {
  const int64_t per_group = stacked ? 1 : E;
  const bool quantized = G > abi::kNumProjections;
  for (int64_t p = 0; p < G; ++p) {
    size_t bytes0 = 0;
    ffi::DataType type0 = ffi::DataType::INVALID;
    for (int64_t i = 0; i < per_group; ++i) {
      auto b = weights.get<ffi::AnyBuffer>(p * per_group + i);
      if (b.has_error()) return b.error();
      const int64_t base = reinterpret_cast<int64_t>(b->untyped_data());
      if (i == 0) {
        bytes0 = b->size_bytes();
        type0 = b->element_type();
        (*first)[p] = static_cast<CUdeviceptr>(base);
      } else if (b->size_bytes() != bytes0 || b->element_type() != type0) {
        return ffi::Error::InvalidArgument("weight group " + std::to_string(p) + " expert " +
                                           std::to_string(i) +
                                           " differs from expert 0 in size or dtype");
      }
      if (stacked) {
        const int64_t stride = static_cast<int64_t>(bytes0) / E;
        for (int64_t e = 0; e < E; ++e) (*addrs)[p * E + e] = base + e * stride;
      } else {
        (*addrs)[p * E + i] = base;
      }
    }
    if (!quantized) {
      const size_t es = ffi::ByteWidth(type0);
      if (es == 0 || (type0 != ffi::DataType::F32 && type0 != ffi::DataType::BF16 &&
                      type0 != ffi::DataType::F16))
        return ffi::Error::InvalidArgument(GroupName(p, G, fused_gate_up) +
                                           " must be float32, bfloat16 or float16");
      (*elems)[p] = static_cast<int64_t>(bytes0 / es) / (stacked ? E : 1);
    }
  }
  return ffi::Error::Success();
}

// The biases after the weight groups (`nbias` float32 buffers from index
// `at` of `weights`: [E, I], [E, I], [E, H]), appended to `extra`.
ffi::Error CollectBiases(ffi::RemainingArgs weights, int64_t at, int64_t nbias, int64_t E,
                         int64_t H, int64_t I, std::vector<CUdeviceptr>* extra) {
  for (int64_t j = 0; j < nbias; ++j) {
    auto b = weights.get<ffi::AnyBuffer>(at + j);
    if (b.has_error()) return b.error();
    const int64_t n = j < 2 ? I : H;
    auto d = b->dimensions();
    if (b->element_type() != ffi::DataType::F32 || d.size() != 2 || d[0] != E || d[1] != n)
      return ffi::Error::InvalidArgument(std::string("the ") + abi::kProjectionNames[j] +
                                         " bias must be float32 [E=" + std::to_string(E) + ", " +
                                         std::to_string(n) + "]");
    extra->push_back(reinterpret_cast<CUdeviceptr>(b->untyped_data()));
  }
  return ffi::Error::Success();
}

// Weights as `groups` groups (gate, up, down; for quantized experts then
// their scales, then (int4) their mins; gate_up, down when `fused_gate_up`),
// each one stacked [E, ...] buffer (`stacked`) or E per-expert buffers, read
// in place through the table and abi.h's views (the kernels add the offsets
// and read the strides: the table holds each expert's whole array), then with
// `has_bias` the three float32 biases [E, I], [E, I], [E, H].
ffi::Error FusedMoeCudaTablesImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                                  ffi::AnyBuffer w, ffi::Buffer<ffi::S32> ids,
                                  ffi::RemainingArgs weights, ffi::Result<ffi::AnyBuffer> y,
                                  ffi::Result<ffi::AnyBuffer> ws_buf, ffi::Span<const uint8_t> blob,
                                  ffi::Span<const int64_t> kernels, ffi::Span<const int64_t> program,
                                  int64_t workspace_bytes, int64_t err_offset,
                                  int64_t err_words, bool w_aligned, int64_t num_experts,
                                  int64_t check_ids, bool graph, int64_t groups,
                                  bool stacked, ffi::Span<const int64_t> views,
                                  int64_t intermediate, bool fused_gate_up, bool has_bias) {
  const int64_t E = num_experts, G = groups;
  const int64_t per_group = stacked ? 1 : E;
  const int64_t nbias = has_bias ? abi::kNumBiases : 0;
  const bool quantized = G > abi::kNumProjections;
  const bool groups_ok = fused_gate_up ? G == 2
                                       : (G % abi::kNumProjections == 0 && G >= abi::kNumProjections &&
                                          G <= abi::kNumParts * abi::kNumProjections);
  if (E < 1 || !groups_ok || static_cast<int64_t>(weights.size()) != G * per_group + nbias)
    return ffi::Error::InvalidArgument(
        "expected " + std::to_string(G * per_group + nbias) + " weight buffers (" +
        std::to_string(G) + " groups of " + std::to_string(per_group) +
        (nbias ? ", then 3 biases" : "") + (fused_gate_up ? "; 2 groups when fused" : "") +
        "); got " + std::to_string(weights.size()));
  if (quantized && (fused_gate_up || has_bias))
    return ffi::Error::InvalidArgument(
        "quantized weights take the plain layout only (no fused gate_up, no biases)");
  const int64_t H = x.dimensions().size() == 2 ? x.dimensions()[1] : -1;
  const int64_t I = intermediate;
  std::vector<int64_t> addrs(G * E);
  std::vector<int64_t> elems(G, 0);  // elements of one expert's array per group (dense)
  std::vector<CUdeviceptr> first(G);
  if (ffi::Error e = CollectGroups(weights, E, G, stacked, fused_gate_up, &addrs, &elems, &first);
      e.failure())
    return e;
  if (std::string why = CheckViews(views, H, I, fused_gate_up, quantized, elems); !why.empty())
    return ffi::Error::InvalidArgument(why);
  std::vector<CUdeviceptr> extra = first;  // the groups' first buffers, then the biases
  if (ffi::Error e = CollectBiases(weights, G * per_group, nbias, E, H, I, &extra); e.failure())
    return e;
  return RunProgram(stream, ordinal, x, w, ids, G, fused_gate_up, extra, addrs, G,
                    {reinterpret_cast<CUdeviceptr>(y->untyped_data())}, ws_buf, blob, kernels,
                    program, workspace_bytes, err_offset, err_words, w_aligned, num_experts,
                    check_ids, graph);
}

// The CUDA backward (abi.h "CUDA backward"; jax_nbx/triton/plan.py
// build_backward): dense experts as the tables handler takes them (`groups`
// groups of one stacked or E per-expert buffers, read through abi.h's views;
// with `has_bias` the three float32 biases), then dy [T, H] in x's dtype.
// Results: dx, d(topk_weights) float32 [T, k], then the weight gradients
// (float32, the weights' shapes and grouping), then with `has_bias` the
// bias gradients, then the workspace.  The gradients' addresses are pointer
// tables groups..2*groups-1, after the weights' (the kernels write each
// expert's gradient through them, stacked or per-expert alike).
ffi::Error FusedMoeBackwardCudaImpl(
    cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer w,
    ffi::Buffer<ffi::S32> ids, ffi::RemainingArgs args, ffi::Result<ffi::AnyBuffer> dx,
    ffi::Result<ffi::Buffer<ffi::F32>> dw, ffi::RemainingRets rets, ffi::Span<const uint8_t> blob,
    ffi::Span<const int64_t> kernels, ffi::Span<const int64_t> program, int64_t workspace_bytes,
    int64_t err_offset, int64_t err_words, bool w_aligned, int64_t num_experts,
    int64_t check_ids, bool graph, int64_t groups,
    bool stacked, ffi::Span<const int64_t> views, int64_t intermediate, bool fused_gate_up,
    bool has_bias, bool grad_f32) {
  const int64_t E = num_experts, G = groups;
  const int64_t per_group = stacked ? 1 : E;
  const int64_t nbias = has_bias ? abi::kNumBiases : 0;
  const bool groups_ok = fused_gate_up ? G == 2 : G == abi::kNumProjections;
  if (E < 1 || !groups_ok || static_cast<int64_t>(args.size()) != G * per_group + nbias + 1)
    return ffi::Error::InvalidArgument(
        "expected " + std::to_string(G * per_group + nbias + 1) + " buffers after topk_ids (" +
        std::to_string(G) + " dense weight groups of " + std::to_string(per_group) +
        (nbias ? ", 3 biases" : "") + ", then dy); got " + std::to_string(args.size()));
  const int64_t n_grads = G * per_group;
  if (static_cast<int64_t>(rets.size()) != n_grads + nbias + 1)
    return ffi::Error::InvalidArgument(
        "expected " + std::to_string(n_grads + nbias + 1) + " results after dx, dw (" +
        std::to_string(n_grads + nbias) + " gradients, then the workspace); got " +
        std::to_string(rets.size()));
  auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("x must be [T, H]");
  const int64_t T = xd[0], H = xd[1], I = intermediate;
  std::vector<int64_t> addrs(2 * G * E);
  std::vector<int64_t> elems(G, 0);
  std::vector<CUdeviceptr> first(G);
  if (ffi::Error e = CollectGroups(args, E, G, stacked, fused_gate_up, &addrs, &elems, &first);
      e.failure())
    return e;
  if (std::string why = CheckViews(views, H, I, fused_gate_up, false, elems); !why.empty())
    return ffi::Error::InvalidArgument(why);
  std::vector<CUdeviceptr> extra = first;  // the groups' first buffers, the biases, then dy
  if (ffi::Error e = CollectBiases(args, n_grads, nbias, E, H, I, &extra); e.failure()) return e;
  auto dy = args.get<ffi::AnyBuffer>(n_grads + nbias);
  if (dy.has_error()) return dy.error();
  auto dyd = dy->dimensions();
  if (dy->element_type() != x.element_type() || dyd.size() != 2 || dyd[0] != T || dyd[1] != H)
    return ffi::Error::InvalidArgument("dy must have x's dtype and shape [T, H]");
  auto dxd = dx->dimensions();
  auto dwd = dw->dimensions();
  auto idd = ids.dimensions();
  auto wd = w.dimensions();  // the kernels read topk_weights and topk_ids at every slot
  if (w.element_type() != ffi::DataType::F32 || wd.size() != 2 || idd.size() != 2 ||
      wd[0] != idd[0] || wd[1] != idd[1] || idd[0] != T)
    return ffi::Error::InvalidArgument(
        "topk_weights must be float32 with topk_ids' shape [T, k], T = x's rows");
  if (dx->element_type() != x.element_type() || dxd.size() != 2 || dxd[0] != T || dxd[1] != H ||
      dwd.size() != 2 || idd.size() != 2 || dwd[0] != idd[0] || dwd[1] != idd[1])
    return ffi::Error::InvalidArgument(
        "dx must have x's dtype and shape, d(topk_weights) topk_ids' shape");
  for (int64_t p = 0; p < G; ++p) {
    for (int64_t i = 0; i < per_group; ++i) {
      auto g = rets.get<ffi::AnyBuffer>(p * per_group + i);
      if (g.has_error()) return g.error();
      // float32, or (grad_f32 false: the program's bwd_dw stores the weights'
      // 16-bit dtype) the weight's own dtype
      auto wt = args.get<ffi::AnyBuffer>(p * per_group);
      if (wt.has_error()) return wt.error();
      const ffi::DataType want = grad_f32 ? ffi::DataType::F32 : wt->element_type();
      if ((*g)->element_type() != want ||
          static_cast<int64_t>((*g)->element_count()) != (stacked ? E : 1) * elems[p])
        return ffi::Error::InvalidArgument(
            "the gradient of " + GroupName(p, G, fused_gate_up) + " must be " +
            (grad_f32 ? "float32" : "in the weight's dtype") + " with the weight's shape");
      const int64_t base = reinterpret_cast<int64_t>((*g)->untyped_data());
      for (int64_t e = stacked ? 0 : i; e < (stacked ? E : i + 1); ++e)
        addrs[(G + p) * E + e] =
            base + (stacked ? e * elems[p] * static_cast<int64_t>(ffi::ByteWidth(want)) : 0);
    }
  }
  static_assert(abi::kOutputDx == 0 && abi::kOutputDTopkWeights == 1 && abi::kOutputDBias0 == 2,
                "outputs[] is built in abi.h's output order");
  std::vector<CUdeviceptr> outputs = {reinterpret_cast<CUdeviceptr>(dx->untyped_data()),
                                      reinterpret_cast<CUdeviceptr>(dw->untyped_data())};
  for (int64_t j = 0; j < nbias; ++j) {
    auto g = rets.get<ffi::AnyBuffer>(n_grads + j);
    if (g.has_error()) return g.error();
    const int64_t n = j < 2 ? I : H;
    auto d = (*g)->dimensions();
    if ((*g)->element_type() != ffi::DataType::F32 || d.size() != 2 || d[0] != E || d[1] != n)
      return ffi::Error::InvalidArgument(std::string("the gradient of the ") +
                                         abi::kProjectionNames[j] + " bias must be float32 [E, " +
                                         std::to_string(n) + "]");
    outputs.push_back(reinterpret_cast<CUdeviceptr>((*g)->untyped_data()));
  }
  auto ws = rets.get<ffi::AnyBuffer>(n_grads + nbias);
  if (ws.has_error()) return ws.error();
  extra.push_back(reinterpret_cast<CUdeviceptr>(dy->untyped_data()));
  return RunProgram(stream, ordinal, x, w, ids, G, fused_gate_up, extra, addrs, 2 * G, outputs,
                    *ws, blob, kernels, program, workspace_bytes, err_offset, err_words,
                    w_aligned, num_experts, check_ids, graph);
}

}  // namespace

void CudaTableStats(int64_t* entries, int64_t* hits, int64_t* misses, int64_t* evictions,
                    int64_t* bytes) {
  TableCache::Get().Stats(entries, hits, misses, evictions, bytes);
}
void CudaTableSetCapacity(int64_t n) { TableCache::Get().SetCapacity(static_cast<size_t>(n)); }
void CudaTableClear() { TableCache::Get().Clear(); }
std::string CudaDriverStatus() {
  Driver& d = Driver::Get();
  return d.ok ? std::string() : d.why;
}

// What both CUDA handlers take besides their weights (the stream, the
// device, x, topk_weights, topk_ids) and return (y, the workspace), and the
// program with its kernels.
#define NBX_PROGRAM_BIND                                    \
  ffi::Ffi::Bind()                                          \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()             \
      .Ctx<ffi::DeviceOrdinal>()                            \
      .Arg<ffi::AnyBuffer>()        /* x [T, H] */          \
      .Arg<ffi::AnyBuffer>()        /* topk_weights [T, k] */ \
      .Arg<ffi::Buffer<ffi::S32>>() /* topk_ids [T, k] */

// The program's attributes (every CUDA handler; jax_nbx/_cuda.py _program_attrs).
#define NBX_PROGRAM_ATTRS                                                  \
  .Attr<ffi::Span<const uint8_t>>("blob")                                  \
      .Attr<ffi::Span<const int64_t>>("kernels")                           \
      .Attr<ffi::Span<const int64_t>>("program")                           \
      .Attr<int64_t>("workspace_bytes")                                    \
      .Attr<int64_t>("err_offset")                                         \
      .Attr<int64_t>("err_words")                                          \
      .Attr<bool>("w_aligned")                                             \
      .Attr<int64_t>("num_experts")                                        \
      .Attr<int64_t>("check_ids")                                          \
      .Attr<bool>("graph")

// The weight groups' attributes of the tables handlers (forward and backward).
#define NBX_GROUP_ATTRS                                                    \
  .Attr<int64_t>("groups")                                                 \
      .Attr<bool>("stacked")                                               \
      .Attr<ffi::Span<const int64_t>>("views") /* abi.h "weight views" */  \
      .Attr<int64_t>("intermediate")                                       \
      .Attr<bool>("fused_gate_up")                                         \
      .Attr<bool>("has_bias")

#define NBX_PROGRAM_RETS_AND_ATTRS                                         \
  .Ret<ffi::AnyBuffer>()                   /* y [T, H] */                  \
      .Ret<ffi::AnyBuffer>()               /* workspace (u8, discarded) */ \
      NBX_PROGRAM_ATTRS

XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedMoeForwardCuda, FusedMoeCudaImpl,
                              NBX_PROGRAM_BIND
                                  .Arg<ffi::AnyBuffer>()         // gate [E, H, I]
                                  .Arg<ffi::AnyBuffer>()         // up [E, H, I]
                                  .Arg<ffi::AnyBuffer>()         // down [E, I, H]
                                  NBX_PROGRAM_RETS_AND_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedMoeForwardCudaTables, FusedMoeCudaTablesImpl,
                              NBX_PROGRAM_BIND
                                  .RemainingArgs()               // weight groups
                                  NBX_PROGRAM_RETS_AND_ATTRS
                                  NBX_GROUP_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedMoeBackwardCuda, FusedMoeBackwardCudaImpl,
                              NBX_PROGRAM_BIND
                                  .RemainingArgs()               // weight groups, biases, dy
                                  .Ret<ffi::AnyBuffer>()         // dx [T, H]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // d(topk_weights) [T, k]
                                  .RemainingRets()               // weight, bias gradients; workspace
                                  NBX_PROGRAM_ATTRS
                                  NBX_GROUP_ATTRS
                                  .Attr<bool>("grad_f32"));

}  // namespace nbx
