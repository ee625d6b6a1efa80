/* The one transport contract of MORI, as a C ABI (version 1).
 *
 * A transport moves bytes between registered memory of two processes: register memory -> a
 * remote key a peer can use; non-blocking put, get, atomics and flush/fence; completion by
 * polling requests. Every feature (SHMEM across nodes, the proxy that serves device-initiated
 * operations, mori-io's RDMA and TCP backends, UMBP, CCO's GDA) reaches other nodes through it, so
 * a transport is written once.
 *
 * Who implements it: mori-core (`tcp`, built in) and plugins (`ucx` in mori-backend-ucx, later
 * `verbs`). A plugin's Python object (mori.core.backend.NetworkTransport) returns a PyCapsule
 * named "mori.transport.v1" holding a pointer to a static `mori_tp_ops`; mori-core's native code
 * calls through it without the GIL. The capsule must stay valid as long as the process lives.
 *
 * Threading: every function may be called from any thread, concurrently, on the same transport
 * instance and the same endpoints (an implementation serialises internally where its library
 * needs it). No function blocks longer than it takes to hand the operation to the library, except
 * `wait` (bounded by its timeout) and `connect` (bounded by the transport's own timeout).
 *
 * Errors: functions return 0 on success, a negative MORI_TP_E* on failure, with a message naming
 * what failed in `err` (always filled on failure; may be NULL, then no message).
 *
 * Ordering and completion (OpenSHMEM semantics):
 *   - an operation's local buffer may be reused once its request completed;
 *   - put completes remotely (visible to the target's loads) by the time a later `flush` on the
 *     same endpoint completes;
 *   - `fence`: every put/atomic posted on the endpoint before it is remotely visible before any
 *     posted after it (put-with-signal = put, fence, atomic);
 *   - atomics are atomic with respect to each other and to the target's own native atomics on the
 *     same word (MORI_TP_CAP_ATOMIC_NATIVE), or only to each other (without that capability);
 *   - atomics reach registered device memory only with MORI_TP_CAP_DEVICE_ATOMIC; without it an
 *     atomic on a peer's device memory fails with MORI_TP_ENOTSUP (it is never executed: a target
 *     CPU touching GPU memory crashes the target).
 *
 * Results and lifetimes:
 *   - an atomic's *old is written by the test() or wait() call that reports the request done, never
 *     later (the caller's storage need not outlive that call); a 32-bit old value is sign-extended
 *     for MORI_TP_WORD_INT32 and zero-extended for MORI_TP_WORD_UINT32;
 *   - a request is released by the test() or wait() that reports it done or failed; one never
 *     tested holds its slot until destroy (implementations bound their request tables and say so);
 *   - dereg() comes after every operation on that memory completed, release_rkey() after every
 *     operation with that key, disconnect() after every operation on that endpoint, destroy() last;
 *   - fence(tp, NULL) is not allowed (fence orders one endpoint's operations).
 *
 * Progress: a target never calls the transport to let peers reach its memory; an implementation
 * whose library needs the target's progress (emulated RMA, software atomics) runs its own thread.
 */
#ifndef MORI_TRANSPORT_H
#define MORI_TRANSPORT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MORI_TRANSPORT_ABI 1
#define MORI_TRANSPORT_CAPSULE "mori.transport.v1"

/* Error codes (negative returns). */
#define MORI_TP_OK 0
#define MORI_TP_EINVAL (-1)      /* an argument is not allowed (named in the message) */
#define MORI_TP_EUNREACH (-2)    /* the peer cannot be reached or went away */
#define MORI_TP_ETIMEDOUT (-3)   /* a wait ran out of time */
#define MORI_TP_ENOTSUP (-4)     /* this transport cannot do that (capability missing) */
#define MORI_TP_EACCESS (-5)     /* the remote side refused: outside registered memory, bad key */
#define MORI_TP_ENOMEM (-6)
#define MORI_TP_EINTERNAL (-7)   /* the underlying library failed (message has its words) */

/* Capabilities (mori_tp_ops.caps). */
#define MORI_TP_CAP_RMA (1u << 0)             /* put and get */
#define MORI_TP_CAP_ATOMIC64 (1u << 1)        /* 64-bit atomics */
#define MORI_TP_CAP_ATOMIC32 (1u << 2)        /* 32-bit atomics */
#define MORI_TP_CAP_ATOMIC_NATIVE (1u << 3)   /* remote atomics are atomic with the target's own CPU atomics */
#define MORI_TP_CAP_CUDA_MEMORY (1u << 4)     /* registers and moves CUDA device memory itself */
#define MORI_TP_CAP_ROCM_MEMORY (1u << 5)     /* registers and moves ROCm device memory itself */
#define MORI_TP_CAP_DEVICE_ATOMIC (1u << 6)   /* atomics on a peer's registered device memory */

/* Memory types for reg(). */
#define MORI_TP_MEM_HOST 0
#define MORI_TP_MEM_CUDA 1
#define MORI_TP_MEM_ROCM 2

/* Atomic operations (the same codes as mori.core.backend OP_*), and word types (WORD_*). */
#define MORI_TP_OP_FETCH 0
#define MORI_TP_OP_SET 1
#define MORI_TP_OP_ADD 2
#define MORI_TP_OP_SWAP 3
#define MORI_TP_OP_AND 4
#define MORI_TP_OP_OR 5
#define MORI_TP_OP_XOR 6
#define MORI_TP_OP_CSWAP 7 /* compare-and-swap: `compare` -> `value` */
#define MORI_TP_WORD_INT32 0
#define MORI_TP_WORD_UINT32 1
#define MORI_TP_WORD_INT64 2
#define MORI_TP_WORD_UINT64 3

typedef struct mori_tp mori_tp;           /* one transport instance (per process, per use) */
typedef struct mori_tp_ep mori_tp_ep;     /* a connection to one peer instance */
typedef struct mori_tp_mem mori_tp_mem;   /* local registered memory */
typedef struct mori_tp_rkey mori_tp_rkey; /* a peer's registered memory, usable on one endpoint */
typedef uint64_t mori_tp_req;             /* a pending operation; 0 = completed already */

typedef struct mori_tp_error {
  int code;
  char message[512];
} mori_tp_error;

typedef struct mori_tp_ops {
  uint32_t abi;       /* MORI_TRANSPORT_ABI */
  uint32_t size;      /* sizeof(mori_tp_ops) of the implementation */
  const char* name;   /* "tcp", "ucx", ... */
  uint32_t caps;      /* MORI_TP_CAP_* */

  /* An instance. `options`: "key=value" pairs separated by ';' (each transport documents its own;
   * unknown keys are an error). */
  mori_tp* (*create)(const char* options, mori_tp_error* err);
  void (*destroy)(mori_tp* tp); /* fails nothing silently: pending requests complete with EUNREACH */

  /* The bytes a peer passes to connect() to reach this instance (exchanged out of band). *len is
   * the buffer's size on entry, the address's on return (MORI_TP_EINVAL and the size needed if too
   * small). */
  int (*address)(mori_tp* tp, void* buf, size_t* len, mori_tp_error* err);
  mori_tp_ep* (*connect)(mori_tp* tp, const void* peer_address, size_t len, mori_tp_error* err);
  void (*disconnect)(mori_tp* tp, mori_tp_ep* ep);

  /* Memory. `device`: the GPU ordinal for device memory, -1 for host memory. */
  mori_tp_mem* (*reg)(mori_tp* tp, void* addr, size_t len, int mem_type, int device, mori_tp_error* err);
  int (*pack_rkey)(mori_tp* tp, mori_tp_mem* mem, void* buf, size_t* len, mori_tp_error* err);
  void (*dereg)(mori_tp* tp, mori_tp_mem* mem); /* after every operation on it completed */
  mori_tp_rkey* (*unpack_rkey)(mori_tp* tp, mori_tp_ep* ep, const void* buf, size_t len, mori_tp_error* err);
  void (*release_rkey)(mori_tp* tp, mori_tp_rkey* rkey);

  /* One-sided operations; `lmem` is the registration holding the local buffer (NULL: the
   * transport finds it or needs none). On success *req is 0 (done) or a request to test/wait. */
  int (*put)(mori_tp* tp, mori_tp_ep* ep, const void* src, mori_tp_mem* lmem, uint64_t raddr, mori_tp_rkey* rkey,
             size_t n, mori_tp_req* req, mori_tp_error* err);
  int (*get)(mori_tp* tp, mori_tp_ep* ep, void* dst, mori_tp_mem* lmem, uint64_t raddr, mori_tp_rkey* rkey,
             size_t n, mori_tp_req* req, mori_tp_error* err);
  /* *old receives the value before the operation (when the request completes). */
  int (*atomic)(mori_tp* tp, mori_tp_ep* ep, int op, int word, uint64_t value, uint64_t compare, uint64_t raddr,
                mori_tp_rkey* rkey, uint64_t* old, mori_tp_req* req, mori_tp_error* err);
  int (*fence)(mori_tp* tp, mori_tp_ep* ep, mori_tp_error* err);
  /* Completes when everything posted before on `ep` (NULL: on every endpoint) is remotely complete. */
  int (*flush)(mori_tp* tp, mori_tp_ep* ep, mori_tp_req* req, mori_tp_error* err);

  /* 1: done (and released), 0: pending, < 0: failed (released, err filled). */
  int (*test)(mori_tp* tp, mori_tp_req req, mori_tp_error* err);
  /* Until done: 1 done, < 0 failed or MORI_TP_ETIMEDOUT (then still pending). timeout_ms < 0: none. */
  int (*wait)(mori_tp* tp, mori_tp_req req, int64_t timeout_ms, mori_tp_error* err);
  /* Drive the library's progress once (transports that need a caller's progress). */
  void (*progress)(mori_tp* tp);
} mori_tp_ops;

#ifdef __cplusplus
}
#endif

#endif /* MORI_TRANSPORT_H */
