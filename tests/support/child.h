// A child process driven by 8-byte commands over pipes, for multi-process tests that must
// interleave steps across processes exactly. Fork children before the parent starts threads
// (opening a pool starts them): threads do not cross a fork.
#ifndef CXLKV_TESTS_SUPPORT_CHILD_H_
#define CXLKV_TESTS_SUPPORT_CHILD_H_

#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>

namespace cxlkv::testing {

// Blocking one-word reads and writes on a pipe end (false at end-of-file or error).
inline bool Get(int fd, uint64_t* v) { return ::read(fd, v, sizeof *v) == sizeof *v; }
inline bool Put(int fd, uint64_t v) { return ::write(fd, &v, sizeof v) == sizeof v; }

struct Child {
  pid_t pid = -1;
  int to_child[2] = {-1, -1};
  int to_parent[2] = {-1, -1};

  // `body(in, out)` runs in the child and its result is the exit code; `in` carries the
  // parent's commands, `out` the child's replies.
  template <typename Body>
  static Child Fork(Body body) {
    Child c;
    if (::pipe(c.to_child) != 0 || ::pipe(c.to_parent) != 0) return c;
    c.pid = ::fork();
    if (c.pid == 0) {
      ::close(c.to_child[1]);
      ::close(c.to_parent[0]);
      ::_exit(body(c.to_child[0], c.to_parent[1]));
    }
    ::close(c.to_child[0]);
    ::close(c.to_parent[1]);
    return c;
  }
  bool Send(uint64_t v) { return Put(to_child[1], v); }
  bool Receive(uint64_t* v) { return Get(to_parent[0], v); }
  // Closes the command pipe and returns the exit code, or 128 + the signal that ended it. A
  // child waiting for a command reads end-of-file — unless a child forked after it holds
  // the pipe open too: with several children alive, send an explicit command first.
  int Wait() {
    ::close(to_child[1]);
    int status = 0;
    ::waitpid(pid, &status, 0);
    ::close(to_parent[0]);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
};

}  // namespace cxlkv::testing

#endif  // CXLKV_TESTS_SUPPORT_CHILD_H_
