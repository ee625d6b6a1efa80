#include "wire.hpp"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

namespace mori::transfer {

const char* const kTimedOut = "timed out";

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string errno_text(int e) { return std::string(strerror(e)) + " (errno " + std::to_string(e) + ")"; }

namespace {

// Advances an iovec list past `moved` bytes from index *i.
void advance(std::vector<iovec>& iov, size_t* i, size_t moved) {
  while (moved > 0 && *i < iov.size()) {
    if (moved >= iov[*i].iov_len) {
      moved -= iov[*i].iov_len;
      iov[*i].iov_len = 0;
      ++*i;
    } else {
      iov[*i].iov_base = static_cast<char*>(iov[*i].iov_base) + moved;
      iov[*i].iov_len -= moved;
      moved = 0;
    }
  }
}

template <typename Fn>
std::string move_iov(std::vector<iovec>& iov, Fn fn, std::atomic<int64_t>* progress) {
  size_t i = 0;
  while (i < iov.size()) {
    if (iov[i].iov_len == 0) {
      ++i;
      continue;
    }
    size_t n = std::min(kIovBatch, iov.size() - i);
    ssize_t r = fn(&iov[i], n);
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return kTimedOut;
      return errno_text(errno);
    }
    if (r == 0) return "connection closed by peer";
    if (progress) progress->store(now_ms(), std::memory_order_relaxed);
    advance(iov, &i, size_t(r));
  }
  return "";
}

void close_fds_in(msghdr* m, std::vector<int>* keep, size_t max_keep) {
  for (cmsghdr* c = CMSG_FIRSTHDR(m); c; c = CMSG_NXTHDR(m, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    const int* fds = reinterpret_cast<const int*>(CMSG_DATA(c));
    for (size_t k = 0; k < n; ++k) {
      int fd;
      std::memcpy(&fd, fds + k, sizeof fd);
      if (keep && keep->size() < max_keep)
        keep->push_back(fd);
      else
        ::close(fd);
    }
  }
}

}  // namespace

std::string send_iov(int fd, std::vector<iovec>& iov, std::atomic<int64_t>* progress) {
  return move_iov(
      iov,
      [fd](iovec* v, size_t n) {
        msghdr m{};
        m.msg_iov = v;
        m.msg_iovlen = n;
        return ::sendmsg(fd, &m, MSG_NOSIGNAL);
      },
      progress);
}

std::string recv_iov(int fd, std::vector<iovec>& iov, std::atomic<int64_t>* progress) {
  return move_iov(iov, [fd](iovec* v, size_t n) { return ::readv(fd, v, int(n)); }, progress);
}

std::string recv_all(int fd, void* buf, size_t len) {
  std::vector<iovec> iov{{buf, len}};
  return recv_iov(fd, iov, nullptr);
}

std::string drain(int fd, uint64_t len) {
  std::vector<char> scratch(1 << 16);
  while (len > 0) {
    size_t n = size_t(std::min<uint64_t>(len, scratch.size()));
    std::string err = recv_all(fd, scratch.data(), n);
    if (!err.empty()) return err;
    len -= n;
  }
  return "";
}

std::string send_msg(int fd, const Header& h, const void* body, const std::vector<iovec>* payload,
                     std::atomic<int64_t>* progress, bool* would_block, const std::vector<int>* fds) {
  std::vector<iovec> iov;
  iov.reserve(2 + (payload ? payload->size() : 0));
  iov.push_back({const_cast<Header*>(&h), sizeof h});
  if (h.body_len) iov.push_back({const_cast<void*>(body), h.body_len});
  if (payload) iov.insert(iov.end(), payload->begin(), payload->end());
  if (would_block) *would_block = false;
  if (would_block || (fds && !fds->empty())) {
    // The first piece by hand: without waiting (would_block), or with the descriptors attached
    // (they travel with the first byte).
    msghdr m{};
    m.msg_iov = iov.data();
    m.msg_iovlen = std::min(kIovBatch, iov.size());
    std::vector<char> control;
    if (fds && !fds->empty()) {
      control.assign(CMSG_SPACE(sizeof(int) * fds->size()), 0);
      m.msg_control = control.data();
      m.msg_controllen = control.size();
      cmsghdr* c = CMSG_FIRSTHDR(&m);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * fds->size());
      std::memcpy(CMSG_DATA(c), fds->data(), sizeof(int) * fds->size());
    }
    ssize_t r;
    do {
      r = ::sendmsg(fd, &m, MSG_NOSIGNAL | (would_block ? MSG_DONTWAIT : 0));
    } while (r < 0 && errno == EINTR);
    if (r < 0 && would_block && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      *would_block = true;
      return "";
    }
    if (r < 0) return errno_text(errno);
    if (progress) progress->store(now_ms(), std::memory_order_relaxed);
    size_t i = 0;
    advance(iov, &i, size_t(r));
  }
  return send_iov(fd, iov, progress);
}

std::string recv_msg(int fd, Header* h, std::vector<uint8_t>* body) {
  std::string err = recv_all(fd, h, sizeof *h);
  if (!err.empty()) return err;
  err = check_header(*h);
  if (!err.empty()) return "malformed message: " + err;
  body->resize(h->body_len);
  if (h->body_len) err = recv_all(fd, body->data(), h->body_len);
  return err;
}

std::string recv_msg_until(int fd, Header* h, std::vector<uint8_t>* body, int64_t deadline_ms, std::vector<int>* fds,
                           size_t max_fds) {
  // Reads `len` bytes into `buf` before the deadline; the first read also takes descriptors.
  auto read_until = [&](void* buf, size_t len, bool take_fds) -> std::string {
    auto* p = static_cast<uint8_t*>(buf);
    while (len > 0) {
      const int64_t left = deadline_ms - now_ms();
      if (left <= 0) return kTimedOut;
      int r = wait_readable(fd, int(std::min<int64_t>(left, 1000)));
      if (r < 0 && errno != EINTR) return errno_text(errno);
      if (r <= 0) continue;
      iovec v{p, len};
      msghdr m{};
      m.msg_iov = &v;
      m.msg_iovlen = 1;
      alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)];
      if (take_fds) {
        m.msg_control = control;
        m.msg_controllen = sizeof control;
      }
      ssize_t n = ::recvmsg(fd, &m, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
      if (n < 0) {
        if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
        return errno_text(errno);
      }
      if (take_fds) {
        close_fds_in(&m, fds, max_fds);
        if (m.msg_flags & MSG_CTRUNC) return "peer passed more descriptors than expected";
        take_fds = false;
      }
      if (n == 0) return "connection closed by peer";
      p += n;
      len -= size_t(n);
    }
    return "";
  };
  std::string err = read_until(h, sizeof *h, fds != nullptr);
  if (!err.empty()) return err;
  err = check_header(*h);
  if (!err.empty()) return "malformed message: " + err;
  body->resize(h->body_len);
  return h->body_len ? read_until(body->data(), h->body_len, false) : "";
}

void set_timeouts(int fd, int64_t ms) {
  timeval tv{};
  tv.tv_sec = ms / 1000;
  tv.tv_usec = (ms % 1000) * 1000;
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

void tune_socket(int fd, int bufsize) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);  // fails harmlessly on a Unix socket
  if (bufsize > 0) {
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bufsize, sizeof bufsize);
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bufsize, sizeof bufsize);
  }
}

int wait_readable(int fd, int ms) {
  pollfd p{fd, POLLIN, 0};
  return ::poll(&p, 1, ms);
}

int cma_copy(bool pull, pid_t pid, std::vector<iovec> local, std::vector<iovec> remote) {
  return cma_copy_in_place(pull, pid, local, remote);
}

int cma_copy_in_place(bool pull, pid_t pid, std::vector<iovec>& local, std::vector<iovec>& remote) {
  size_t i = 0;
  while (i < local.size()) {
    if (local[i].iov_len == 0) {
      ++i;
      continue;
    }
    size_t n = std::min(kIovBatch, local.size() - i);
    ssize_t r = pull ? ::process_vm_readv(pid, &local[i], n, &remote[i], n, 0)
                     : ::process_vm_writev(pid, &local[i], n, &remote[i], n, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (r == 0) return EFAULT;
    size_t left = size_t(r);
    while (left > 0 && i < local.size()) {
      if (left >= local[i].iov_len) {
        left -= local[i].iov_len;
        local[i].iov_len = remote[i].iov_len = 0;
        ++i;
      } else {
        local[i].iov_base = static_cast<char*>(local[i].iov_base) + left;
        remote[i].iov_base = static_cast<char*>(remote[i].iov_base) + left;
        local[i].iov_len -= left;
        remote[i].iov_len -= left;
        left = 0;
      }
    }
  }
  return 0;
}

}  // namespace mori::transfer
