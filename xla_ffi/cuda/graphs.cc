// The CUDA-graph cache (see graphs.h).
//
// A graph executable is keyed by its device and every launch's function,
// grid, block and shared memory; at most kGraphCacheEntries are kept (least
// recently used dropped: an executable still running is freed by the driver
// when it completes).  Per call every node's arguments are updated
// (cuGraphExecKernelNodeSetParams copies them).  Updates and the launch of
// one executable happen under its mutex, so concurrent calls never
// interleave them; the driver orders launches of one executable.
#include "cuda/graphs.h"

#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <utility>

#include "cuda/driver.h"
#include "lru.h"

namespace ffi = xla::ffi;

namespace nbx::cuda {
namespace {

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

}  // namespace

ffi::Error LaunchAsGraph(int ordinal, const std::vector<KernelCall>& calls, CUstream stream) {
  return GraphCache::Get().Launch(ordinal, calls, stream);
}

}  // namespace nbx::cuda
