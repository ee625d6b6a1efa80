// One atomic read-modify-write on a word of this process's memory, sequentially consistent: what a
// remote peer's atomic (the TCP transport's kAtomic) does to the target's registered memory, with
// the same codes as the transport contract (mori/transport.h: MORI_TP_OP_*, MORI_TP_WORD_*).
#pragma once

#include <cstdint>

namespace mori::transfer {

// Returns false for an op or word code outside the contract. *old: the word before.
template <typename T>
bool atomic_rmw_word(T* p, int op, T value, T compare, T* old) {
  constexpr int mo = __ATOMIC_SEQ_CST;
  switch (op) {
    case 0: *old = __atomic_load_n(p, mo); return true;                       // fetch
    case 1: *old = __atomic_exchange_n(p, value, mo); return true;            // set: one exchange
    case 2: *old = __atomic_fetch_add(p, value, mo); return true;             // add
    case 3: *old = __atomic_exchange_n(p, value, mo); return true;            // swap
    case 4: *old = __atomic_fetch_and(p, value, mo); return true;             // and
    case 5: *old = __atomic_fetch_or(p, value, mo); return true;              // or
    case 6: *old = __atomic_fetch_xor(p, value, mo); return true;             // xor
    case 7: {                                                                 // compare-and-swap
      T expected = compare;
      __atomic_compare_exchange_n(p, &expected, value, false, mo, mo);
      *old = expected;  // the value found: == compare if it swapped
      return true;
    }
    default: return false;
  }
}

// The width of word type `word` (0 int32, 1 uint32, 2 int64, 3 uint64), 0 if unknown.
inline unsigned word_bytes(int word) { return word == 0 || word == 1 ? 4 : word == 2 || word == 3 ? 8 : 0; }

// `op` on the word of type `word` at `addr` (aligned, in this process); *old widened to 64 bits.
inline bool atomic_rmw_at(uintptr_t addr, int op, int word, uint64_t value, uint64_t compare, uint64_t* old) {
  if (word_bytes(word) == 4) {
    uint32_t o = 0;
    if (!atomic_rmw_word(reinterpret_cast<uint32_t*>(addr), op, uint32_t(value), uint32_t(compare), &o)) return false;
    *old = o;
    return true;
  }
  if (word_bytes(word) == 8) return atomic_rmw_word(reinterpret_cast<uint64_t*>(addr), op, value, compare, old);
  return false;
}

}  // namespace mori::transfer
