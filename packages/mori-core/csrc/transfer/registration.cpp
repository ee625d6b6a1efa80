// The registration table: regions registered for peers, their ids and bounds, the pins transfers
// hold on them, and their entries in the shared table (huge-page hints included).
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <stdexcept>

#include "engine.hpp"
#include "sys.hpp"
#include "wire.hpp"

namespace mori::transfer {

namespace {
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25  // Linux >= 6.1
#endif
constexpr uintptr_t kHugePage = uintptr_t(2) << 20;

// Manners::thp (MORI_IO_THP=1, off by default: it changes the paging of the caller's memory).
// Backs the 2 MiB-aligned interior of registered CPU memory with transparent huge pages: the
// same-host path's process_vm_readv/writev pins the target's pages one page-table lock per 4 KiB
// page otherwise (measured here: 512 KiB in 24 us on 4 KiB pages, 16 us on huge pages), and two
// threads copying halves of one transfer contend on that lock (512 KiB cut in two: 53 us).
// MADV_HUGEPAGE marks the range (later faults get huge pages); MADV_COLLAPSE moves what is already
// there onto huge pages, up to Manners::thp_collapse_max bytes (it costs ~3 ms per MiB). Neither
// changes a byte of the contents. The kernel refuses both for mappings it cannot collapse (device
// mappings, pinned pages) and the range keeps its pages; so does a kernel without THP.
void back_with_huge_pages(uintptr_t lo, uintptr_t hi, uint64_t collapse_max) {
  const uint64_t n = hi - lo;
  if (::madvise(reinterpret_cast<void*>(lo), n, MADV_HUGEPAGE) != 0) return;
  if (n <= collapse_max) ::madvise(reinterpret_cast<void*>(lo), n, MADV_COLLAPSE);
}

// The 2 MiB-aligned interior of [addr, addr + size) if the kernel maps (nearly) all of it with
// 2 MiB pages now, else an empty range: the table's huge_lo/huge_hi, a speed hint for the
// initiator (table.hpp). Huge pages come from the caller (its allocator, MADV_HUGEPAGE, hugetlbfs)
// or from Manners::thp. Read from /proc/self/smaps (AnonHugePages, ShmemPmdMapped, FilePmdMapped,
// or a hugetlb KernelPageSize) of the mappings the interior overlaps; once per registration.
std::pair<uintptr_t, uintptr_t> huge_interior(uintptr_t addr, uint64_t size) {
  const uintptr_t lo = (addr + kHugePage - 1) & ~(kHugePage - 1), hi = (addr + size) & ~(kHugePage - 1);
  if (hi <= lo) return {0, 0};
  FILE* f = std::fopen("/proc/self/smaps", "re");
  if (!f) return {0, 0};
  char line[512];
  uint64_t overlap = 0, huge = 0, vma_overlap = 0;
  bool in = false, done = false;
  while (!done && std::fgets(line, sizeof line, f)) {
    unsigned long long a, b;
    char perms[8];
    if (std::sscanf(line, "%llx-%llx %7s", &a, &b, perms) == 3) {  // a mapping's first line
      if (a >= hi) done = true;
      in = !done && b > lo;
      vma_overlap = in ? std::min<uint64_t>(b, hi) - std::max<uint64_t>(a, lo) : 0;
      overlap += vma_overlap;
      continue;
    }
    if (!in) continue;
    unsigned long long kb;
    if (std::sscanf(line, "AnonHugePages: %llu kB", &kb) == 1 || std::sscanf(line, "ShmemPmdMapped: %llu kB", &kb) == 1 ||
        std::sscanf(line, "FilePmdMapped: %llu kB", &kb) == 1)
      huge += std::min<uint64_t>(kb << 10, vma_overlap);
    else if (std::sscanf(line, "KernelPageSize: %llu kB", &kb) == 1 && (kb << 10) >= kHugePage)
      huge += vma_overlap;  // hugetlbfs: every page of the mapping is huge
  }
  std::fclose(f);
  const uint64_t n = hi - lo;
  return overlap >= n && huge * 8 >= n * 7 ? std::make_pair(lo, hi) : std::make_pair(uintptr_t(0), uintptr_t(0));
}

// Whether [addr, addr + size) is mapped in this process: msync(MS_ASYNC) checks the range against
// the process's mappings (ENOMEM for a hole) and does nothing else (a no-op since Linux 2.6.19).
bool mapped(uintptr_t addr, uint64_t size) {
  const uintptr_t page = uintptr_t(::sysconf(_SC_PAGESIZE));
  const uintptr_t lo = addr & ~(page - 1);
  return ::msync(reinterpret_cast<void*>(lo), size_t(addr + size - lo), MS_ASYNC) == 0;
}
}  // namespace

uint64_t Engine::register_memory(uintptr_t addr, uint64_t size, int loc, int device) {
  if (size == 0) throw std::invalid_argument("size=0 is not allowed; expected at least one byte");
  if (addr == 0 || addr > UINTPTR_MAX - size)
    throw std::invalid_argument("addr=" + std::to_string(addr) + " + size=" + std::to_string(size) +
                                " is not a range of this address space (it wraps around or starts at 0)");
  if (loc == 1 && !mapped(addr, size))
    throw std::invalid_argument("addr=" + std::to_string(addr) + " + size=" + std::to_string(size) +
                                " is not mapped memory of this process (msync: " + errno_text(errno) + ")");
  // Before taking the lock: collapsing takes milliseconds per MiB, smaps a moment.
  std::pair<uintptr_t, uintptr_t> huge{0, 0};
  if (loc == 1 && table_ && size >= kHugePage) {
    if (cfg_.manners.thp) {
      const uintptr_t lo = (addr + kHugePage - 1) & ~(kHugePage - 1), hi = (addr + size) & ~(kHugePage - 1);
      if (hi > lo) back_with_huge_pages(lo, hi, cfg_.manners.thp_collapse_max);
    }
    huge = huge_interior(addr, size);
  }
  auto r = std::make_shared<Region>();
  r->addr = addr;
  r->size = size;
  r->loc = loc;
  r->device = device;
  std::lock_guard<std::mutex> g(reg_mu_);
  // Ids are random (a peer cannot guess the ids of regions it was not given) with their table
  // index in the low bits: a free index when there is one, so the region is published.
  const bool publish = table_ && loc == 1 && !shut_;
  uint64_t index = 0;
  bool have_index = false;
  if (publish) {
    const uint64_t start = random_u64() % kTableEntries;
    for (uint64_t k = 0; k < kTableEntries && !have_index; ++k) {
      index = (start + k) % kTableEntries;
      have_index = table_entry(index)->id.load(std::memory_order_relaxed) == 0;
    }
  }
  do {
    const uint64_t high = random_u64() >> 15;  // ids stay below 2**63 (a Python int, an int64 elsewhere)
    r->id = have_index ? (high / kTableEntries) * kTableEntries + index : high;
  } while (r->id == 0 || regions_.count(r->id));
  regions_[r->id] = r;
  if (have_index) {
    table_write_entry(table_entry(r->id), r->id, EntryView{addr, size, huge.first, huge.second});
    r->published = true;
  }
  return r->id;
}
bool Engine::deregister_memory(uint64_t id, int64_t timeout_ms) {
  const int64_t deadline = timeout_ms < 0 ? -1 : now_ms() + timeout_ms;
  std::unique_lock<std::mutex> g(reg_mu_);
  auto it = regions_.find(id);
  if (it == regions_.end()) return true;
  RegionPtr r = it->second;
  r->alive = false;
  regions_.erase(it);
  const bool published = r->published;
  if (published) {  // retire the entry, then wait for initiators' copies that may have read it
    table_write_entry(table_entry(id), 0, EntryView{});
    r->published = false;
  }
  g.unlock();
  bool copies_done = !published || wait_copies(deadline);
  g.lock();
  auto idle = [&r] { return r->inflight == 0; };
  if (deadline < 0) {
    reg_cv_.wait(g, idle);
    return copies_done;
  }
  bool served = reg_cv_.wait_for(g, std::chrono::milliseconds(std::max<int64_t>(0, deadline - now_ms())), idle);
  return copies_done && served;
}

bool Engine::has_memory(uint64_t id) {
  std::lock_guard<std::mutex> g(reg_mu_);
  return regions_.count(id) != 0;
}

RegionPtr Engine::pin(uint64_t id, const Seg* segs, size_t n, std::string* err) {
  std::lock_guard<std::mutex> g(reg_mu_);
  auto it = regions_.find(id);
  if (it == regions_.end() || !it->second->alive) {
    *err = "memory region " + std::to_string(id) + " of engine '" + cfg_.key +
           "' is not registered (unknown or deregistered)";
    return nullptr;
  }
  const RegionPtr& r = it->second;
  for (size_t i = 0; i < n; ++i) {
    if (segs[i].off > r->size || segs[i].len > r->size - segs[i].off) {
      *err = "offset " + std::to_string(segs[i].off) + " + size " + std::to_string(segs[i].len) +
             " is outside memory region " + std::to_string(id) + " of engine '" + cfg_.key + "' (" +
             std::to_string(r->size) + " bytes)";
      return nullptr;
    }
  }
  ++r->inflight;
  return r;
}

void Engine::unpin(const RegionPtr& r) {
  bool wake;
  {
    std::lock_guard<std::mutex> g(reg_mu_);
    wake = --r->inflight == 0 && !r->alive;
  }
  if (wake) reg_cv_.notify_all();
}

}  // namespace mori::transfer
