// Runs a call's launch program on XLA's stream (see runner.h).
//
// The workspace is a second output buffer that XLA allocates in its own pool
// and the caller discards (XLA's FFI ScratchAllocator refused even 2.6 kB on
// jax 0.11.2 on an H200, 2026-11-29); it is counted in the account first.
#include "cuda/runner.h"

#include <memory>
#include <string>

#include "abi.h"
#include "account.h"
#include "cuda/cubins.h"
#include "cuda/driver.h"
#include "cuda/graphs.h"
#include "cuda/id_checks.h"
#include "cuda/program.h"
#include "cuda/tables.h"
#include "cuda/weights.h"

namespace ffi = xla::ffi;

namespace nbx::cuda {
namespace {

// Decodes the kernel table and the program and checks the pointer tables
// against them: their size, and the weights' 16-byte alignment where the
// kernels were compiled assuming it.
ffi::Error Decode(const ProgramCall& c, const ProgramAttrs& a, std::vector<KernelRow>* rows,
                  std::vector<LaunchRef>* launches) {
  const int64_t E = a.num_experts, G = c.groups;
  if (std::string why = DecodeKernelTable(a.kernels.begin(), a.kernels.size(), a.blob.size(), rows);
      !why.empty())
    return ffi::Error::InvalidArgument(why);
  const int64_t n_kernels = static_cast<int64_t>(rows->size());
  if (std::string why = DecodeProgram(a.program.begin(), a.program.size(), n_kernels,
                                      abi::kInputGroup0 + static_cast<int64_t>(c.extra.size()),
                                      c.n_tables, a.workspace_bytes, launches,
                                      static_cast<int64_t>(c.outputs.size()));
      !why.empty())
    return ffi::Error::InvalidArgument(why);
  if (static_cast<int64_t>(c.addrs.size()) != c.n_tables * E || c.n_tables < G)
    return ffi::Error::InvalidArgument("pointer table has " + std::to_string(c.addrs.size()) +
                                       " entries; expected " + std::to_string(c.n_tables) +
                                       " * E = " + std::to_string(c.n_tables * E));
  if (a.w_aligned)
    for (int64_t p = 0; p < G; ++p)
      for (int64_t e = 0; e < E; ++e)
        if (c.addrs[p * E + e] % 16 != 0) {
          return ffi::Error::InvalidArgument(
              GroupName(p, G, c.fused) + " expert " + std::to_string(e) +
              " starts at an address that is not 16-byte aligned, but the kernels were compiled "
              "assuming it is");
        }
  return ffi::Error::Success();
}

// Where a launch's pointer arguments point (cuda/program.h ArgRef): the
// call's inputs (abi.h's order) and outputs, its workspace, the weights'
// cached tables 0..G-1, and tables G.. at the workspace's start.
struct ArgBases {
  std::vector<CUdeviceptr> inputs;
  const std::vector<CUdeviceptr>& outputs;
  CUdeviceptr ws, table, call_table;
  int64_t G, E;
};

// The launches as the driver takes them, with the argument values their
// `params` point to: all stay alive (and in place) until the launches are
// made, one by one or as a graph.
struct Launches {
  std::vector<std::vector<uint64_t>> ptr_store;
  std::vector<std::vector<int32_t>> i32_store;
  std::vector<std::vector<void*>> param_store;
  std::vector<KernelCall> calls;  // the launches whose grid is not empty, in order
};

// Every index and workspace offset was checked by DecodeProgram.
void BuildLaunches(const std::vector<LaunchRef>& launches, const std::vector<LoadedKernel>& loaded,
                   const ArgBases& b, Launches* out) {
  const size_t n_launches = launches.size();
  out->ptr_store.resize(n_launches);
  out->i32_store.resize(n_launches);
  out->param_store.resize(n_launches);
  static uint64_t null_scratch = 0;  // Triton's global and profile scratch: unused
  for (size_t li = 0; li < n_launches; ++li) {
    const LaunchRef& ln = launches[li];
    const size_t nargs = ln.args.size();
    std::vector<uint64_t>& ptr_vals = out->ptr_store[li];
    std::vector<int32_t>& i32_vals = out->i32_store[li];
    std::vector<void*>& params = out->param_store[li];
    ptr_vals.assign(nargs, 0);
    i32_vals.assign(nargs, 0);
    for (size_t a = 0; a < nargs; ++a) {
      const ArgRef& r = ln.args[a];
      switch (r.kind) {
        case abi::ArgKind::kInput: ptr_vals[a] = b.inputs[r.index] + r.offset; break;
        case abi::ArgKind::kOutput: ptr_vals[a] = b.outputs[r.index] + r.offset; break;
        case abi::ArgKind::kWorkspace: ptr_vals[a] = b.ws + r.offset; break;
        case abi::ArgKind::kTable:
          ptr_vals[a] = r.index < b.G ? b.table + r.index * b.E * sizeof(int64_t)
                                      : b.call_table + (r.index - b.G) * b.E * sizeof(int64_t);
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
    out->calls.push_back(KernelCall{k.fn,
                                    {static_cast<unsigned>(gx), static_cast<unsigned>(gy),
                                     static_cast<unsigned>(gz)},
                                    static_cast<unsigned>(32 * k.num_warps),
                                    static_cast<unsigned>(k.shared), params.data()});
  }
}

}  // namespace

ffi::Error RunProgram(const ProgramCall& c, const ProgramAttrs& a) {
  Driver& d = Driver::Get();
  if (!d.ok) return ffi::Error(ffi::ErrorCode::kFailedPrecondition, d.why);
  const Device dev{"cuda", c.ordinal};
  const CUstream stream = reinterpret_cast<CUstream>(c.stream);
  const int64_t E = a.num_experts, G = c.groups;
  const int64_t workspace_bytes = a.workspace_bytes, err_offset = a.err_offset,
                err_words = a.err_words;
  std::vector<KernelRow> rows;
  std::vector<LaunchRef> launches;
  if (auto e = Decode(c, a, &rows, &launches); e.failure()) return e;

  // Workspace: counted first, then taken from XLA's pool.
  std::string err;
  void* unused = nullptr;
  const int64_t T = c.x.dimensions().size() > 0 ? c.x.dimensions()[0] : 0;
  const int64_t H = c.x.dimensions().size() > 1 ? c.x.dimensions()[1] : 0;
  if (!Account::Get().Reserve(dev, workspace_bytes, "workspace", WorkShape{T, H, 0}, &err,
                              &unused))
    return ffi::Error(ffi::ErrorCode::kResourceExhausted, err);
  struct Unreserve {
    Device dev;
    int64_t bytes;
    ~Unreserve() { Account::Get().Release(dev, bytes, "workspace", nullptr); }
  } unreserve{dev, workspace_bytes};
  if (static_cast<int64_t>(c.workspace.size_bytes()) < workspace_bytes)
    return ffi::Error::InvalidArgument("workspace buffer of " +
                                       std::to_string(c.workspace.size_bytes()) +
                                       " bytes; the program needs " + std::to_string(workspace_bytes));
  const CUdeviceptr ws = reinterpret_cast<CUdeviceptr>(c.workspace.untyped_data());
  if (err_words < 1 || err_offset < 0 || err_offset + 4 * err_words > workspace_bytes)
    return ffi::Error::InvalidArgument("the expert-id check's " + std::to_string(err_words) +
                                       " words at offset " + std::to_string(err_offset) +
                                       " do not fit the workspace of " +
                                       std::to_string(workspace_bytes) + " bytes");
  if (ws % abi::kWorkspaceAlign != 0)
    return ffi::Error::InvalidArgument("workspace buffer is not " +
                                       std::to_string(abi::kWorkspaceAlign) + "-byte aligned");

  ScopedContext ctx;
  if (auto e = ctx.Enter(c.ordinal); e.failure()) return e;
  // Deferred id checks (small calls only: the copies are bounded): an earlier
  // call's bad slot, once its copy has landed, fails this call.
  const int64_t n_slots = static_cast<int64_t>(c.ids.element_count());
  const int64_t kk = c.ids.dimensions().size() > 1 ? c.ids.dimensions()[1] : 1;
  const bool deferred = a.check_ids == abi::kIdCheckDeferred &&
                        err_words <= abi::kMaxDeferredErrWords &&
                        n_slots <= abi::kMaxDeferredErrWords;
  if (a.check_ids == abi::kIdCheckDeferred)
    if (std::string bad = PollDeferredIdChecks(dev); !bad.empty())
      return ffi::Error::InvalidArgument(bad);
  // The weights' G tables: cached (the weights stay put); tables G.. (the
  // backward's gradients, new buffers every call): uploaded per call.
  std::shared_ptr<CudaTable> table_ref;
  const std::vector<int64_t> weight_addrs(c.addrs.begin(), c.addrs.begin() + G * E);
  if (auto e = LookupTable(dev, weight_addrs, &table_ref); e.failure()) return e;
  const CUdeviceptr table = table_ref->ptr;
  // The backward's gradient tables: at offset 0 of this call's workspace (abi.h
  // "CUDA backward"), uploaded on the call's stream before its launches.  From
  // pageable memory: the driver copies `addrs` before returning (it may wait
  // for the stream to do so, per CUDA's documented behaviour).
  const CUdeviceptr call_table = ws;
  if (c.n_tables > G) {
    const int64_t bytes = (c.n_tables - G) * E * static_cast<int64_t>(sizeof(int64_t));
    if (bytes > workspace_bytes || err_offset < bytes)
      return ffi::Error::InvalidArgument(
          "the workspace does not start with the gradients' pointer tables (" +
          std::to_string(bytes) + " bytes)");
    NBX_CU("uploading the gradients' pointer tables",
           d.cuMemcpyHtoDAsync(call_table, c.addrs.data() + G * E, bytes, stream));
  }

  const int64_t n_kernels = static_cast<int64_t>(rows.size());
  std::vector<LoadedKernel> loaded(n_kernels);
  for (int64_t i = 0; i < n_kernels; ++i)
    if (auto e = GetKernel(c.ordinal, a.blob.begin(), rows[i], &loaded[i]); e.failure())
      return e;

  // numbered as abi::kInputX, kInputW, kInputIds, then kInputGroup0 + group, then the biases
  ArgBases bases{{reinterpret_cast<CUdeviceptr>(c.x.untyped_data()),
                  reinterpret_cast<CUdeviceptr>(c.w.untyped_data()),
                  reinterpret_cast<CUdeviceptr>(c.ids.typed_data())},
                 c.outputs, ws, table, call_table, G, E};
  static_assert(abi::kInputX == 0 && abi::kInputW == 1 && abi::kInputIds == 2 &&
                    abi::kInputGroup0 == 3,
                "inputs[] is built in abi.h's input order");
  bases.inputs.insert(bases.inputs.end(), c.extra.begin(), c.extra.end());

  Launches built;
  BuildLaunches(launches, loaded, bases, &built);
  if (a.graph) {
    if (auto e = LaunchAsGraph(c.ordinal, built.calls, stream); e.failure()) return e;
  } else {
    for (const KernelCall& k : built.calls)
      NBX_CU("cuLaunchKernel",
             d.cuLaunchKernel(k.fn, k.grid[0], k.grid[1], k.grid[2], k.block, 1, 1, k.shared,
                              stream, k.params, nullptr));
  }

  const CUdeviceptr ids = bases.inputs[abi::kInputIds];
  if (deferred)
    return EnqueueDeferredIdCheck(dev, stream, ws + err_offset, err_words, ids, n_slots, kk, E);
  if (a.check_ids != abi::kIdCheckOff)
    return CheckIdsNow(stream, ws + err_offset, err_words, ids, n_slots, kk, E);
  return ffi::Error::Success();
}

}  // namespace nbx::cuda
