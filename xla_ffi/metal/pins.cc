// Pinned scopes (see pins.h).
#include "metal/pins.h"

#include <algorithm>
#include <utility>

namespace nbx::metal {

namespace {
int64_t Addr(const char* p) { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(p)); }
char* Ptr(int64_t a) { return reinterpret_cast<char*>(static_cast<uintptr_t>(a)); }

// Arrays grouped by the span of pages that wraps them: one span per host
// allocation the device knows (its whole pages, however many arrays it
// holds), and for memory it cannot place, one per run of arrays whose pages
// touch or overlap.
struct Span {
  int64_t lo, hi;            // page-aligned
  std::vector<size_t> arrays;
  int64_t longest = 0;       // the longest array's page-rounded extent
  const char* allocation;    // the known allocation, or nullptr
};

std::vector<Span> Spans(metal::Device& d, const std::vector<HostRange>& ranges) {
  std::vector<Span> spans;
  std::vector<size_t> order(ranges.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return ranges[a].ptr < ranges[b].ptr; });
  for (size_t i : order) {
    const HostRange& r = ranges[i];
    if (r.bytes <= 0) continue;
    int64_t lo = PageFloor(Addr(r.ptr)), hi = PageCeil(Addr(r.ptr) + r.bytes);
    const int64_t extent = hi - lo;
    const char* base = nullptr;
    int64_t len = 0;
    if (d.AllocationOf(r.ptr, &base, &len) && Addr(r.ptr) + r.bytes <= Addr(base) + len) {
      lo = PageFloor(Addr(base));  // the whole allocation, once
      hi = PageCeil(Addr(base) + len);
    } else {
      base = nullptr;
    }
    Span* same = nullptr;  // the span of this allocation, or the last unknown run it touches
    for (Span& s : spans)
      if (base != nullptr ? s.allocation == base : (s.allocation == nullptr && lo <= s.hi && s.lo <= hi))
        same = &s;
    if (same != nullptr) {
      same->lo = std::min(same->lo, lo);
      same->hi = std::max(same->hi, hi);
      same->arrays.push_back(i);
      same->longest = std::max(same->longest, extent);
    } else {
      spans.push_back(Span{lo, hi, {i}, extent, base});
    }
  }
  return spans;
}
}  // namespace

PinnedScope& PinnedScope::operator=(PinnedScope&& o) noexcept {
  if (this != &o) {
    Unpin();
    views_ = std::exchange(o.views_, {});
    staging_ = std::exchange(o.staging_, {});
    staging_buf_ = std::move(o.staging_buf_);
  }
  return *this;
}

bool PinnedScope::Pin(const std::vector<HostRange>& ranges, PinnedScope* out, std::string* error,
                      bool* exhausted) {
  if (exhausted != nullptr) *exhausted = false;
  out->Unpin();
  metal::Device* d = Active();
  if (d == nullptr) {
    *error = "no Metal device is active";
    return false;
  }
  const int64_t max_len = PageFloor(d->info().max_buffer_length);
  PinnedScope scope;
  int64_t staged_bytes = 0;  // the staged copies' extent in the one staging buffer
  for (const Span& s : Spans(*d, ranges)) {
    // Views of at most max_len bytes stepping so that every array lies inside one.
    if (s.longest > max_len) {
      *error = "an array of " + FormatBytes(static_cast<double>(s.longest)) +
               " (page-rounded) exceeds the Metal device's maxBufferLength of " +
               FormatBytes(static_cast<double>(max_len));
      return false;
    }
    const int64_t step = s.hi - s.lo <= max_len ? s.hi - s.lo : max_len - s.longest;
    if (step <= 0) {
      *error = "an array of " + FormatBytes(static_cast<double>(s.longest)) +
               " (page-rounded) fills the Metal device's maxBufferLength: no overlapping views "
               "of its allocation can hold it beside its neighbours";
      return false;
    }
    bool refused = false;
    const size_t first_view = scope.views_.size();
    for (int64_t lo = s.lo; lo < s.hi && !refused;) {
      const int64_t len = std::min(max_len, s.hi - lo);
      Buffer w;
      std::string why;
      switch (d->Wrap(Ptr(lo), len, &w, &why)) {
        case metal::Device::WrapResult::kOk:
          scope.views_.push_back(View{Ptr(lo), w});
          break;
        case metal::Device::WrapResult::kRefused:
          refused = true;  // staged below
          break;
        case metal::Device::WrapResult::kAtLimit:
          *error = "pinning the experts needs more no-copy wraps than the Metal device allows (" +
                   why + "; " + std::to_string(d->live_wraps()) +
                   " live): release pinned tables (jax_nbx.tables.release_pinned()) or hold "
                   "fewer weight allocations";
          return false;
        case metal::Device::WrapResult::kInvalid:
          *error = "internal: " + why;
          return false;
      }
      if (lo + len >= s.hi) break;
      lo += step;
    }
    if (refused) {  // this allocation cannot be wrapped: its arrays are copied instead (below)
      for (size_t v = first_view; v < scope.views_.size(); ++v) d->Release(scope.views_[v].wrap);
      scope.views_.resize(first_view);
      for (size_t i : s.arrays) {
        scope.staging_.push_back(Staged{ranges[i].ptr, ranges[i].bytes, staged_bytes});
        staged_bytes = (scope.staging_.back().offset + ranges[i].bytes + 63) / 64 * 64;
      }
    }
  }
  if (!scope.staging_.empty()) {
    // one request for every copy: a call never waits on copies it holds itself
    const Staged& last = scope.staging_.back();
    if (!DeviceBuffer::Allocate(last.offset + last.bytes, "staging", WorkShape{}, &scope.staging_buf_,
                                error)) {
      if (exhausted != nullptr) *exhausted = true;
      return false;
    }
    for (const Staged& st : scope.staging_)
      d->Memcpy(scope.staging_buf_.buffer(), st.offset, st.host, st.bytes);
  }
  *out = std::move(scope);
  return true;
}

uint64_t PinnedScope::GpuAddress(const void* p, int64_t bytes) const {
  const char* c = static_cast<const char*>(p);
  for (const Staged& s : staging_)
    if (c >= s.host && c + bytes <= s.host + s.bytes)
      return staging_buf_.buffer().gpu + static_cast<uint64_t>(s.offset + (c - s.host));
  for (const View& v : views_)
    if (c >= v.host && c + bytes <= v.host + v.wrap.length) return v.wrap.gpu + (c - v.host);
  return 0;
}

std::vector<Buffer> PinnedScope::resources() const {
  std::vector<Buffer> out;
  for (const View& v : views_) out.push_back(v.wrap);
  if (!staging_.empty()) out.push_back(staging_buf_.buffer());
  return out;
}

bool PinnedScope::Current() const {
  metal::Device* d = Active();
  if (d == nullptr) return false;
  for (const View& v : views_)
    if (!d->WrapCurrent(v.wrap)) return false;
  return true;
}

void PinnedScope::Unpin() {
  if (metal::Device* d = Active())
    for (const View& v : views_) d->Release(v.wrap);
  views_.clear();
  staging_.clear();
  staging_buf_.Reset();  // the account counts its bytes free
}

}  // namespace nbx::metal
