// Host atomics, waits and fences on raw addresses (usually inside the symmetric heap, which peers
// map too). Every operation is sequentially consistent, so a signal written after a put is never
// seen before the put's bytes, by any process on the node.
//
// Waits release the GIL, back off from spinning to yielding to sleeping, honour a timeout and wake
// for Python signals (Ctrl-C) about every 100 ms.
#include <sched.h>
#include <time.h>

#include <chrono>
#include <cstdint>
#include <string>

#include "errors.hpp"
#include "registry.hpp"

namespace py = pybind11;

namespace mori {
namespace {

enum class Op : int { kFetch = 0, kSet = 1, kAdd = 2, kSwap = 3, kAnd = 4, kOr = 5, kXor = 6 };
enum class Cmp : int { kEq = 0, kNe = 1, kGt = 2, kGe = 3, kLt = 4, kLe = 5 };
enum class Word : int { kInt32 = 0, kUInt32 = 1, kInt64 = 2, kUInt64 = 3 };

template <typename T>
T checked(py::handle value, const char* func) {
  T v{};
  if (!fits<T>(value, func, "value", &v))
    raise_error("MoriValueError", "value " + repr_of(value) + " does not fit the atomic word");
  return v;
}

template <typename T>
T* word_at(py::handle addr_arg, const char* func) {
  const auto addr = int_arg<std::uintptr_t>(addr_arg, func, "addr");
  if (addr == 0) raise_error("MoriValueError", "address is 0 (null)");
  if (addr % sizeof(T) != 0)
    raise_error("MoriValueError", "address " + std::to_string(addr) + " is not aligned to " +
                                      std::to_string(sizeof(T)) + " bytes");
  return reinterpret_cast<T*>(addr);
}

template <typename T>
T rmw(T* p, Op op, T v) {
  constexpr int mo = __ATOMIC_SEQ_CST;
  switch (op) {
    case Op::kFetch: return __atomic_load_n(p, mo);
    // SET returns the value it replaced, so it is an exchange: a load followed by a store would
    // lose a peer's update landing between the two, and report an old value that never was.
    case Op::kSet:
    case Op::kSwap: return __atomic_exchange_n(p, v, mo);
    case Op::kAdd: return __atomic_fetch_add(p, v, mo);
    case Op::kAnd: return __atomic_fetch_and(p, v, mo);
    case Op::kOr: return __atomic_fetch_or(p, v, mo);
    case Op::kXor: return __atomic_fetch_xor(p, v, mo);
  }
  raise_error("MoriValueError", "unknown atomic op " + std::to_string(static_cast<int>(op)));
}

template <typename T>
bool compare(T cur, Cmp cmp, T v) {
  switch (cmp) {
    case Cmp::kEq: return cur == v;
    case Cmp::kNe: return cur != v;
    case Cmp::kGt: return cur > v;
    case Cmp::kGe: return cur >= v;
    case Cmp::kLt: return cur < v;
    case Cmp::kLe: return cur <= v;
  }
  raise_error("MoriValueError", "unknown comparison " + std::to_string(static_cast<int>(cmp)));
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Returns (reached, last value seen). timeout_s < 0 waits forever.
template <typename T>
py::tuple wait_until(py::handle addr, Cmp cmp, py::handle value, double timeout_s) {
  T* p = word_at<T>(addr, "wait_until");
  T v = checked<T>(value, "wait_until");
  (void)compare<T>(T{}, cmp, v);  // reject a bad comparison before blocking
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  auto next_signal_check = start + std::chrono::milliseconds(100);
  T cur{};
  bool reached = false;
  long sleep_ns = 2000;
  for (std::uint64_t iter = 0;; ++iter) {
    {
      py::gil_scoped_release nogil;
      for (;; ++iter) {
        cur = __atomic_load_n(p, __ATOMIC_SEQ_CST);
        if (compare(cur, cmp, v)) { reached = true; break; }
        if (iter < 4096) { cpu_relax(); continue; }
        auto now = clock::now();
        double waited = std::chrono::duration<double>(now - start).count();
        if (timeout_s >= 0 && waited >= timeout_s) break;
        if (now >= next_signal_check) break;
        if (waited < 1e-3) { sched_yield(); continue; }
        timespec ts{0, sleep_ns};
        nanosleep(&ts, nullptr);
        if (sleep_ns < 200000) sleep_ns *= 2;
      }
    }
    if (reached) break;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    double waited = std::chrono::duration<double>(clock::now() - start).count();
    if (timeout_s >= 0 && waited >= timeout_s) break;
    next_signal_check = clock::now() + std::chrono::milliseconds(100);
  }
  return py::make_tuple(reached, py::int_(cur));
}

template <typename F>
auto by_word(Word w, F&& f) {
  switch (w) {
    case Word::kInt32: return f(std::int32_t{});
    case Word::kUInt32: return f(std::uint32_t{});
    case Word::kInt64: return f(std::int64_t{});
    case Word::kUInt64: return f(std::uint64_t{});
  }
  raise_error("MoriValueError", "unknown word type " + std::to_string(static_cast<int>(w)));
}

// A small int code (op, comparison, word type); its meaning is checked where it is used.
int code_arg(py::handle v, const char* func, const char* arg) { return int_arg<int>(v, func, arg); }

}  // namespace

void register_atomics(py::module_& m) {
  m.def(
      "atomic_rmw",
      [](py::handle addr, py::handle op, py::handle word, py::handle value) {
        const char* func = "atomic_rmw";
        const auto o = static_cast<Op>(code_arg(op, func, "op"));
        return by_word(static_cast<Word>(code_arg(word, func, "word")), [&](auto t) {
          using T = decltype(t);
          T* p = word_at<T>(addr, func);
          return py::int_(rmw<T>(p, o, checked<T>(value, func)));
        });
      },
      py::arg("addr"), py::arg("op"), py::arg("word"), py::arg("value"),
      "Sequentially consistent read-modify-write of one word; returns the previous value.\n"
      "op: 0 fetch, 1 set, 2 add, 3 swap, 4 and, 5 or, 6 xor. word: 0 int32, 1 uint32, 2 int64, 3 uint64.");
  m.def(
      "atomic_compare_swap",
      [](py::handle addr, py::handle word, py::handle expected, py::handle desired) {
        const char* func = "atomic_compare_swap";
        return by_word(static_cast<Word>(code_arg(word, func, "word")), [&](auto t) {
          using T = decltype(t);
          T* p = word_at<T>(addr, func);
          T exp = checked<T>(expected, func);
          T des = checked<T>(desired, func);
          __atomic_compare_exchange_n(p, &exp, des, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
          return py::int_(exp);  // the value found, whether or not it was replaced
        });
      },
      py::arg("addr"), py::arg("word"), py::arg("expected"), py::arg("desired"),
      "If the word equals `expected`, replace it with `desired`; return the value found.");
  m.def(
      "wait_until",
      [](py::handle addr, py::handle cmp, py::handle word, py::handle value, py::handle timeout_s) {
        const char* func = "wait_until";
        const auto c = static_cast<Cmp>(code_arg(cmp, func, "cmp"));
        const double timeout = float_arg(timeout_s, func, "timeout_s");
        return by_word(static_cast<Word>(code_arg(word, func, "word")), [&](auto t) {
          return wait_until<decltype(t)>(addr, c, value, timeout);
        });
      },
      py::arg("addr"), py::arg("cmp"), py::arg("word"), py::arg("value"), py::arg("timeout_s"),
      "Block (GIL released) until `word at addr <cmp> value`; returns (reached, last value).\n"
      "cmp: 0 eq, 1 ne, 2 gt, 3 ge, 4 lt, 5 le. timeout_s < 0 waits forever.");
  m.def(
      "fence", [] { __atomic_thread_fence(__ATOMIC_SEQ_CST); },
      "Full memory fence: every store before it is visible to every process before any store after it.");
}

}  // namespace mori
