#include "account.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>

namespace nbx {
namespace {

struct DeviceState {
  DeviceStats stats;
  std::vector<std::pair<void*, int64_t>> idle;  // blocks kept for reuse
  void (*free_block)(void*) = &std::free;         // how a block goes (Account::SetBlockFree)
  DeviceState() { stats.budget = Account::kUnlimited; }

  // Frees idle blocks (oldest first) until live + cached + need fits the budget.
  void EvictFor(int64_t need) {
    while (!idle.empty() && need > stats.budget - stats.live - stats.cached) {
      free_block(idle.front().first);
      stats.cached -= idle.front().second;
      idle.erase(idle.begin());
    }
  }
};

struct Ledger {
  std::mutex mu;
  std::condition_variable returned;  // signalled whenever bytes come back
  std::map<std::string, DeviceState> devices;
  std::optional<Refusal> last_refusal;
  int64_t wait_ms = 10000;
};

Ledger& L() {
  static Ledger* ledger = new Ledger();  // never destroyed: handlers may run at exit
  return *ledger;
}

std::string ShapeText(const WorkShape& s) {
  return "(" + std::to_string(s.rows) + ", " + std::to_string(s.cols) + ")";
}

}  // namespace

std::string FormatBytes(double b, Round round) {
  // the unit and the printed step (one decimal of kB or MB, two of GB)
  const double unit = b < 1e3 ? 1.0 : b < 1e6 ? 1e3 : b < 1e9 ? 1e6 : 1e9;
  const double step = b < 1e3 ? 1.0 : b < 1e9 ? unit / 10 : unit / 100;
  const double q = b / step;
  // (q - nearbyint(q)) guards against a value one rounding error above a whole step
  const double steps = round == Round::kUp     ? std::ceil(q - 1e-9)
                       : round == Round::kDown ? std::floor(q + 1e-9)
                                               : std::nearbyint(q);
  const double v = steps * step;
  char buf[64];
  if (unit == 1.0) std::snprintf(buf, sizeof buf, "%.0f bytes", v);
  else if (unit == 1e3) std::snprintf(buf, sizeof buf, "%.1f kB", v / 1e3);
  else if (unit == 1e6) std::snprintf(buf, sizeof buf, "%.1f MB", v / 1e6);
  else std::snprintf(buf, sizeof buf, "%.2f GB", v / 1e9);
  return buf;
}

std::string WhatWouldHaveFit(int64_t requested, int64_t free, int64_t total,
                             const WorkShape& shape) {
  if (requested <= free) return "";
  free = std::max<int64_t>(free, 0);
  // Every amount of the advice is rounded up (enough to follow it), "free" down.
  std::string s = "short by " + FormatBytes(static_cast<double>(requested - free), Round::kUp);
  if (shape.known()) {
    const double per_row =
        static_cast<double>(requested - shape.fixed_bytes) / shape.rows;
    const int64_t rows_fit =
        (per_row > 0 && free > shape.fixed_bytes)
            ? static_cast<int64_t>(std::floor((free - shape.fixed_bytes) / per_row))
            : 0;
    if (rows_fit >= 1) {
      const int64_t n = (shape.rows + rows_fit - 1) / rows_fit;
      const int64_t rows = (shape.rows + n - 1) / n;
      s += "; it would fit in " + std::to_string(n) + " bands of about " +
           FormatBytes(shape.fixed_bytes + per_row * rows, Round::kUp) +
           "; cutting the leading axis of " + ShapeText(shape) + " from " +
           std::to_string(shape.rows) + " to " + std::to_string(rows) +
           " per band";
    } else {
      s += "; no band split alone reaches it: one row of the leading axis of " +
           ShapeText(shape) + " already needs " +
           FormatBytes(shape.fixed_bytes + per_row, Round::kUp) + " with " +
           FormatBytes(static_cast<double>(free), Round::kDown) + " free";
    }
  }
  const int64_t used = std::max<int64_t>(total - free, 0);
  s += "; a budget of " + FormatBytes(static_cast<double>(used + requested), Round::kUp) +
       " would have taken it whole";
  if (requested > total) s += " (the request alone exceeds the whole budget of " +
                              FormatBytes(static_cast<double>(total)) + ")";
  return s;
}

Account& Account::Get() {
  static Account account;
  return account;
}

void Account::SetBudget(const Device& d, int64_t bytes) {
  std::lock_guard<std::mutex> lock(L().mu);
  DeviceState& st = L().devices[d.Name()];
  st.stats.budget = bytes;
  st.EvictFor(0);
  L().returned.notify_all();
}

void Account::SetBlockFree(const Device& d, void (*free_block)(void*)) {
  std::lock_guard<std::mutex> lock(L().mu);
  L().devices[d.Name()].free_block = free_block != nullptr ? free_block : &std::free;
}

void Account::DropCached() {
  std::lock_guard<std::mutex> lock(L().mu);
  for (auto& [name, st] : L().devices) {
    for (auto& [p, n] : st.idle) st.free_block(p);
    st.idle.clear();
    st.stats.cached = 0;
  }
  L().returned.notify_all();
}

void Account::SetWaitMillis(int64_t ms) {
  std::lock_guard<std::mutex> lock(L().mu);
  L().wait_ms = std::max<int64_t>(ms, 0);
}

DeviceStats Account::Stats(const Device& d) {
  std::lock_guard<std::mutex> lock(L().mu);
  return L().devices[d.Name()].stats;
}

std::vector<std::pair<std::string, DeviceStats>> Account::AllStats() {
  std::lock_guard<std::mutex> lock(L().mu);
  std::vector<std::pair<std::string, DeviceStats>> out;
  for (auto& [name, st] : L().devices) out.emplace_back(name, st.stats);
  return out;
}

void Account::ResetPeak() {
  std::lock_guard<std::mutex> lock(L().mu);
  for (auto& [name, st] : L().devices) st.stats.peak = st.stats.live;
}

std::optional<Refusal> Account::LastRefusal() {
  std::lock_guard<std::mutex> lock(L().mu);
  return L().last_refusal;
}

bool Account::Reserve(const Device& d, int64_t bytes, const char* tag,
                      const WorkShape& shape, std::string* error, void** reuse) {
  Ledger& l = L();
  std::unique_lock<std::mutex> lock(l.mu);
  DeviceState& st = l.devices[d.Name()];
  DeviceStats& s = st.stats;
  s.largest_request = std::max(s.largest_request, bytes);
  *reuse = nullptr;
  for (size_t i = 0; i < st.idle.size(); ++i) {
    if (st.idle[i].second == bytes) {  // an idle block of this size: it moves to live
      *reuse = st.idle[i].first;
      st.idle.erase(st.idle.begin() + static_cast<std::ptrdiff_t>(i));
      s.cached -= bytes;
      break;
    }
  }
  // Idle blocks give way to live requests.
  auto fits = [&] {
    st.EvictFor(bytes);
    return bytes <= s.budget - s.live - s.cached;
  };
  const bool contended = !fits() && bytes <= s.budget && s.live > 0;
  if (contended) {
    // It fits the budget: wait for concurrent calls to return their bytes.
    l.returned.wait_for(lock, std::chrono::milliseconds(l.wait_ms), fits);
  }
  if (!fits()) {
    Refusal r;
    r.device = d;
    r.tag = tag;
    r.requested = bytes;
    r.free = std::max<int64_t>(s.budget - s.live, 0);
    r.total = s.budget;
    r.shortfall = bytes - r.free;
    r.shape = shape;
    r.message = "jax_nbx account (" + d.Name() + ") refused " +
                FormatBytes(static_cast<double>(bytes), Round::kUp) + " of " + tag + ": " +
                FormatBytes(static_cast<double>(r.free), Round::kDown) + " free of a " +
                FormatBytes(static_cast<double>(s.budget)) + " budget; ";
    if (contended && bytes <= s.budget)  // (the budget may have been lowered meanwhile)
      r.message += "short by " + FormatBytes(static_cast<double>(r.shortfall), Round::kUp) +
                   "; the request fits the budget alone, but concurrent calls held " +
                   FormatBytes(static_cast<double>(s.live)) + " for the " +
                   std::to_string(l.wait_ms) +
                   " ms it waited: run fewer calls at once, wait longer "
                   "(jax_nbx.memory.set_wait), or plan smaller bands (max_workspace_bytes)";
    else
      r.message += WhatWouldHaveFit(bytes, r.free, s.budget, shape);
    ++s.refusals;
    *error = r.message;
    l.last_refusal = std::move(r);
    if (*reuse != nullptr) {
      st.free_block(*reuse);
      *reuse = nullptr;
    }
    return false;
  }
  s.live += bytes;
  s.peak = std::max(s.peak, s.live);
  s.live_by_tag[tag] += bytes;
  ++s.allocations;
  return true;
}

void Account::Release(const Device& d, int64_t bytes, const char* tag, void* ptr) {
  std::lock_guard<std::mutex> lock(L().mu);
  DeviceState& st = L().devices[d.Name()];
  DeviceStats& s = st.stats;
  s.live -= bytes;
  s.live_by_tag[tag] -= bytes;
  if (ptr != nullptr) {
    if (bytes >= kMinIdleBytes && static_cast<int>(st.idle.size()) < kIdleBlocks &&
        bytes <= s.budget - s.live - s.cached) {
      st.idle.emplace_back(ptr, bytes);
      s.cached += bytes;
    } else {
      st.free_block(ptr);
    }
  }
  L().returned.notify_all();
}

Workspace& Workspace::operator=(Workspace&& o) noexcept {
  if (this != &o) {
    Release();
    ptr_ = o.ptr_;
    bytes_ = o.bytes_;
    tag_ = o.tag_;
    device_ = std::move(o.device_);
    o.ptr_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

bool Workspace::Allocate(const Device& d, size_t bytes, const char* tag,
                         const WorkShape& shape, Workspace* out,
                         std::string* error) {
  out->Release();
  if (bytes == 0) return true;
  void* p = nullptr;
  if (!Account::Get().Reserve(d, SaturatedBytes(bytes), tag, shape, error, &p))
    return false;
  constexpr size_t kAlign = 64;
  if (p == nullptr) p = std::aligned_alloc(kAlign, (bytes + kAlign - 1) / kAlign * kAlign);
  if (p == nullptr) {
    Account::Get().Release(d, static_cast<int64_t>(bytes), tag, nullptr);
    *error = "jax_nbx: the system could not provide " +
             FormatBytes(static_cast<double>(bytes)) + " of " + tag +
             " on " + d.Name() + " although the account allowed it";
    return false;
  }
  out->ptr_ = p;
  out->bytes_ = bytes;
  out->tag_ = tag;
  out->device_ = d;
  return true;
}

void Workspace::Release() {
  if (ptr_ != nullptr) {
    Account::Get().Release(device_, static_cast<int64_t>(bytes_), tag_, ptr_);  // frees or keeps idle
    ptr_ = nullptr;
    bytes_ = 0;
  }
}

}  // namespace nbx
