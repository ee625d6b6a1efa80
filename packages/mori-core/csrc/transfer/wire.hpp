// Moving messages (protocol.hpp) over a connected stream socket, TCP or Unix: the only code that
// reads or writes a peer's bytes on a socket. Every function returns "" on success, else the reason.
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "protocol.hpp"

namespace mori::transfer {

int64_t now_ms();
std::string errno_text(int e);

constexpr size_t kIovBatch = 1024;  // IOV_MAX on Linux
extern const char* const kTimedOut;  // a socket send/receive timeout (SO_SNDTIMEO/SO_RCVTIMEO) fired

// All of `iov` out / in, advancing on partial progress; `progress` (optional) gets now_ms() after
// each piece.
std::string send_iov(int fd, std::vector<iovec>& iov, std::atomic<int64_t>* progress);
std::string recv_iov(int fd, std::vector<iovec>& iov, std::atomic<int64_t>* progress);
std::string recv_all(int fd, void* buf, size_t len);
// Reads and discards `len` bytes.
std::string drain(int fd, uint64_t len);

// Header, body and payload as one message. With `would_block`, the first sendmsg does not wait:
// if the socket buffer is full before a byte went out, *would_block is set and nothing is sent.
// `fds` (Unix sockets only): descriptors passed with the message (SCM_RIGHTS).
std::string send_msg(int fd, const Header& h, const void* body, const std::vector<iovec>* payload,
                     std::atomic<int64_t>* progress, bool* would_block = nullptr, const std::vector<int>* fds = nullptr);

// One header and its body; rejects anything the parser does not accept before allocating.
std::string recv_msg(int fd, Header* h, std::vector<uint8_t>* body);
// The same, all of it before `deadline_ms` (now_ms() clock), however slowly the peer sends; with
// `fds`, descriptors the peer passed with the message (at most `max_fds`, close-on-exec; any beyond
// are closed) are appended there.
std::string recv_msg_until(int fd, Header* h, std::vector<uint8_t>* body, int64_t deadline_ms,
                           std::vector<int>* fds = nullptr, size_t max_fds = 0);

void set_timeouts(int fd, int64_t ms);
void tune_socket(int fd, int bufsize);
// poll(POLLIN): >0 readable, 0 timeout, <0 error.
int wait_readable(int fd, int ms);

// Cross-memory attach of matching local/remote iovec lists (same lengths pairwise) with process
// `pid`: pull = process_vm_readv (remote -> local). Returns 0 or the errno of the failure.
int cma_copy(bool pull, pid_t pid, std::vector<iovec> local, std::vector<iovec> remote);
// The same on the caller's lists, which it advances as bytes move (no copy of them).
int cma_copy_in_place(bool pull, pid_t pid, std::vector<iovec>& local, std::vector<iovec>& remote);

}  // namespace mori::transfer
