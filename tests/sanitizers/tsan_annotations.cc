// ThreadSanitizer annotations for the synchronization that Debian's
// uninstrumented libraries do behind ThreadSanitizer's back. Linked into
// every program of a KARAT_SANITIZE=thread build (CMakeLists.txt), nowhere
// else.
//
// absl::Mutex, absl::CondVar and absl::Notification are implemented in
// libabsl_synchronization.so with atomics and futexes; a ThreadSanitizer
// build of Abseil would annotate them (ABSL_TSAN_MUTEX_* in mutex.cc), but
// Debian's is not one, so ThreadSanitizer would see no ordering at all between
// two critical sections of the same absl::Mutex and would report every
// variable that KARAT guards with one. This file defines the public member
// functions itself; the program's definitions take precedence over the shared
// library's (for gRPC's and Abseil's own calls too, through the PLT), call
// the library's through dlsym(RTLD_NEXT) and tell ThreadSanitizer what
// happened with its mutex annotation interface (sanitizer/tsan_interface.h),
// as an instrumented Abseil would.
//
// libgomp's parallel regions start and end on futex barriers that
// ThreadSanitizer cannot see either: what the encountering thread wrote
// before a region would race with the team's reads in it, and the team's
// writes with the thread's reads after it. GOMP_parallel (the one region
// entry point that KARAT's objects call; `nm -u` lists them) is wrapped the
// same way, with a release/acquire pair at each edge. Races between the
// team's threads inside a region are still reported. Barriers inside a
// region (GOMP_barrier, GOMP_loop_end) are not annotated: KARAT's regions
// have none (their loops are `nowait`); one added later would show up as a
// report of a race across it.
//
// Not annotated: Mutex::Await's and LockWhen's conditions, which Abseil may
// evaluate on another thread while it holds the mutex; they run inside the
// library call, where ThreadSanitizer ignores accesses (between the pre and
// post annotations).

#include <dlfcn.h>
#include <sanitizer/tsan_interface.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/base/options.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace {

// The mangled name of absl::<rest>, e.g. "5Mutex4LockEv" (the symbol's text
// after the namespace prefix, which `nm -D libabsl_synchronization.so` shows):
// Debian's Abseil puts everything in an inline namespace.
std::string AbslSymbol(const char* rest, bool const_method = false) {
  std::string s = const_method ? "_ZNK4absl" : "_ZN4absl";
#if ABSL_OPTION_USE_INLINE_NAMESPACE
#define KARAT_TSAN_STR2(x) #x
#define KARAT_TSAN_STR(x) KARAT_TSAN_STR2(x)
  const std::string ns = KARAT_TSAN_STR(ABSL_OPTION_INLINE_NAMESPACE_NAME);
  s += std::to_string(ns.size()) + ns;
#else
#error "tsan_annotations.cc expects Abseil built with an inline namespace"
#endif
  return s + rest;
}

// The next definition of `name` after this program's: the shared library's.
template <typename F>
F Next(const std::string& name) {
  void* f = dlsym(RTLD_NEXT, name.c_str());
  if (f == nullptr) {
    fprintf(stderr,
            "tsan_annotations: no %s after the program's own definition "
            "(%s); the Abseil or libgomp this program loaded does not match "
            "the one tests/sanitizers/tsan_annotations.cc was written for\n",
            name.c_str(), dlerror());
    abort();
  }
  return reinterpret_cast<F>(f);
}

using absl::Condition;
using absl::CondVar;
using absl::Duration;
using absl::Mutex;
using absl::Notification;
using absl::Time;

// Which mutexes this thread holds in reader mode, so that a wait that
// releases and reacquires a mutex annotates the mode it is held in.
constexpr int kMaxReaderHeld = 16;
thread_local const Mutex* reader_held[kMaxReaderHeld];
thread_local int reader_held_count = 0;

void NoteReaderLock(const Mutex* mu) {
  if (reader_held_count < kMaxReaderHeld) {
    reader_held[reader_held_count++] = mu;
  }
}
void NoteReaderUnlock(const Mutex* mu) {
  for (int i = reader_held_count - 1; i >= 0; --i) {
    if (reader_held[i] == mu) {
      reader_held[i] = reader_held[--reader_held_count];
      return;
    }
  }
}
unsigned HeldMode(const Mutex* mu) {
  for (int i = 0; i < reader_held_count; ++i) {
    if (reader_held[i] == mu) return __tsan_mutex_read_lock;
  }
  return 0;
}

// Abseil's functions call one another through the PLT too (AwaitWithTimeout
// calls AwaitWithDeadline, Notification's calls lock its Mutex): only the
// outermost call on a thread is annotated, the ones it makes pass straight
// through.
thread_local int library_depth = 0;

template <typename Call>
auto InLibrary(Call call) {
  ++library_depth;
  auto result = call();
  --library_depth;
  return result;
}

struct Unit {};

// A blocking call that releases `mu` for a while and holds it again when it
// returns (Mutex::Await, CondVar::Wait): a release before it, an acquire
// after it, and the call itself ignored, as for the lock operations.
template <typename Call>
auto ReleasedDuring(Mutex* mu, Call call) {
  if (library_depth > 0) return call();
  const unsigned mode = HeldMode(mu);
  __tsan_mutex_pre_unlock(mu, mode);
  auto result = InLibrary(call);
  __tsan_mutex_post_unlock(mu, mode);
  __tsan_mutex_pre_lock(mu, mode);
  __tsan_mutex_post_lock(mu, mode, 0);
  return result;
}

// A lock operation (`call` returns whether it took the lock).
template <typename Call>
bool Locking(Mutex* mu, unsigned mode, Call call) {
  if (library_depth > 0) return call();
  __tsan_mutex_pre_lock(mu, mode);
  const bool ok = InLibrary(call);
  __tsan_mutex_post_lock(
      mu, ok ? mode : mode | __tsan_mutex_try_lock_failed, 0);
  if (ok && (mode & __tsan_mutex_read_lock)) NoteReaderLock(mu);
  return ok;
}

template <typename Call>
void Unlocking(Mutex* mu, unsigned mode, Call call) {
  if (library_depth > 0) {
    call();
    return;
  }
  if (mode & __tsan_mutex_read_lock) NoteReaderUnlock(mu);
  __tsan_mutex_pre_unlock(mu, mode);
  InLibrary([&] {
    call();
    return Unit{};
  });
  __tsan_mutex_post_unlock(mu, mode);
}

// The library's functions, looked up once.
struct Real {
  void (*lock)(Mutex*) = Next<void (*)(Mutex*)>(AbslSymbol("5Mutex4LockEv"));
  void (*unlock)(Mutex*) =
      Next<void (*)(Mutex*)>(AbslSymbol("5Mutex6UnlockEv"));
  bool (*try_lock)(Mutex*) =
      Next<bool (*)(Mutex*)>(AbslSymbol("5Mutex7TryLockEv"));
  void (*reader_lock)(Mutex*) =
      Next<void (*)(Mutex*)>(AbslSymbol("5Mutex10ReaderLockEv"));
  void (*reader_unlock)(Mutex*) =
      Next<void (*)(Mutex*)>(AbslSymbol("5Mutex12ReaderUnlockEv"));
  bool (*reader_try_lock)(Mutex*) =
      Next<bool (*)(Mutex*)>(AbslSymbol("5Mutex13ReaderTryLockEv"));
  void (*lock_when)(Mutex*, const Condition&) =
      Next<void (*)(Mutex*, const Condition&)>(
          AbslSymbol("5Mutex8LockWhenERKNS0_9ConditionE"));
  bool (*lock_when_timeout)(Mutex*, const Condition&, Duration) =
      Next<bool (*)(Mutex*, const Condition&, Duration)>(AbslSymbol(
          "5Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE"));
  bool (*lock_when_deadline)(Mutex*, const Condition&, Time) =
      Next<bool (*)(Mutex*, const Condition&, Time)>(AbslSymbol(
          "5Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE"));
  void (*reader_lock_when)(Mutex*, const Condition&) =
      Next<void (*)(Mutex*, const Condition&)>(
          AbslSymbol("5Mutex14ReaderLockWhenERKNS0_9ConditionE"));
  bool (*reader_lock_when_timeout)(Mutex*, const Condition&, Duration) =
      Next<bool (*)(Mutex*, const Condition&, Duration)>(AbslSymbol(
          "5Mutex25ReaderLockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE"));
  bool (*reader_lock_when_deadline)(Mutex*, const Condition&, Time) =
      Next<bool (*)(Mutex*, const Condition&, Time)>(AbslSymbol(
          "5Mutex26ReaderLockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE"));
  void (*await)(Mutex*, const Condition&) =
      Next<void (*)(Mutex*, const Condition&)>(
          AbslSymbol("5Mutex5AwaitERKNS0_9ConditionE"));
  bool (*await_timeout)(Mutex*, const Condition&, Duration) =
      Next<bool (*)(Mutex*, const Condition&, Duration)>(AbslSymbol(
          "5Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE"));
  bool (*await_deadline)(Mutex*, const Condition&, Time) =
      Next<bool (*)(Mutex*, const Condition&, Time)>(AbslSymbol(
          "5Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE"));
  void (*destroy)(Mutex*) = Next<void (*)(Mutex*)>(AbslSymbol("5MutexD1Ev"));
  void (*cv_wait)(CondVar*, Mutex*) =
      Next<void (*)(CondVar*, Mutex*)>(AbslSymbol("7CondVar4WaitEPNS0_5MutexE"));
  bool (*cv_wait_timeout)(CondVar*, Mutex*, Duration) =
      Next<bool (*)(CondVar*, Mutex*, Duration)>(AbslSymbol(
          "7CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE"));
  bool (*cv_wait_deadline)(CondVar*, Mutex*, Time) =
      Next<bool (*)(CondVar*, Mutex*, Time)>(
          AbslSymbol("7CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE"));
  void (*notify)(Notification*) =
      Next<void (*)(Notification*)>(AbslSymbol("12Notification6NotifyEv"));
  void (*wait_notification)(const Notification*) =
      Next<void (*)(const Notification*)>(
          AbslSymbol("12Notification19WaitForNotificationEv", true));
  bool (*wait_notification_timeout)(const Notification*, Duration) =
      Next<bool (*)(const Notification*, Duration)>(AbslSymbol(
          "12Notification30WaitForNotificationWithTimeoutENS0_8DurationE",
          true));
  bool (*wait_notification_deadline)(const Notification*, Time) =
      Next<bool (*)(const Notification*, Time)>(AbslSymbol(
          "12Notification31WaitForNotificationWithDeadlineENS0_4TimeE", true));
};

const Real& R() {
  static const Real* real = new Real;
  return *real;
}

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

void Mutex::Lock() {
  Locking(this, 0, [&] {
    R().lock(this);
    return true;
  });
}
void Mutex::Unlock() {
  Unlocking(this, 0, [&] { R().unlock(this); });
}
bool Mutex::TryLock() {
  return Locking(this, __tsan_mutex_try_lock,
                 [&] { return R().try_lock(this); });
}
void Mutex::ReaderLock() {
  Locking(this, __tsan_mutex_read_lock, [&] {
    R().reader_lock(this);
    return true;
  });
}
void Mutex::ReaderUnlock() {
  Unlocking(this, __tsan_mutex_read_lock, [&] { R().reader_unlock(this); });
}
bool Mutex::ReaderTryLock() {
  return Locking(this, __tsan_mutex_try_read_lock,
                 [&] { return R().reader_try_lock(this); });
}

// LockWhen*'s result says whether the condition held; the lock is taken
// either way.
void Mutex::LockWhen(const Condition& cond) {
  Locking(this, 0, [&] {
    R().lock_when(this, cond);
    return true;
  });
}
bool Mutex::LockWhenWithTimeout(const Condition& cond, Duration timeout) {
  bool met = false;
  Locking(this, 0, [&] {
    met = R().lock_when_timeout(this, cond, timeout);
    return true;
  });
  return met;
}
bool Mutex::LockWhenWithDeadline(const Condition& cond, Time deadline) {
  bool met = false;
  Locking(this, 0, [&] {
    met = R().lock_when_deadline(this, cond, deadline);
    return true;
  });
  return met;
}
void Mutex::ReaderLockWhen(const Condition& cond) {
  Locking(this, __tsan_mutex_read_lock, [&] {
    R().reader_lock_when(this, cond);
    return true;
  });
}
bool Mutex::ReaderLockWhenWithTimeout(const Condition& cond,
                                      Duration timeout) {
  bool met = false;
  Locking(this, __tsan_mutex_read_lock, [&] {
    met = R().reader_lock_when_timeout(this, cond, timeout);
    return true;
  });
  return met;
}
bool Mutex::ReaderLockWhenWithDeadline(const Condition& cond, Time deadline) {
  bool met = false;
  Locking(this, __tsan_mutex_read_lock, [&] {
    met = R().reader_lock_when_deadline(this, cond, deadline);
    return true;
  });
  return met;
}

void Mutex::Await(const Condition& cond) {
  ReleasedDuring(this, [&] {
    R().await(this, cond);
    return Unit{};
  });
}
bool Mutex::AwaitWithTimeout(const Condition& cond, Duration timeout) {
  return ReleasedDuring(this,
                        [&] { return R().await_timeout(this, cond, timeout); });
}
bool Mutex::AwaitWithDeadline(const Condition& cond, Time deadline) {
  return ReleasedDuring(
      this, [&] { return R().await_deadline(this, cond, deadline); });
}

Mutex::~Mutex() {
  if (library_depth == 0) __tsan_mutex_destroy(this, __tsan_mutex_not_static);
  R().destroy(this);
}

void CondVar::Wait(Mutex* mu) {
  ReleasedDuring(mu, [&] {
    R().cv_wait(this, mu);
    return Unit{};
  });
}
bool CondVar::WaitWithTimeout(Mutex* mu, Duration timeout) {
  return ReleasedDuring(
      mu, [&] { return R().cv_wait_timeout(this, mu, timeout); });
}
bool CondVar::WaitWithDeadline(Mutex* mu, Time deadline) {
  return ReleasedDuring(
      mu, [&] { return R().cv_wait_deadline(this, mu, deadline); });
}

// What the notifying thread did before Notify happens before what a waiter
// does after its wait returns true.
void Notification::Notify() {
  if (library_depth == 0) __tsan_release(this);
  InLibrary([&] {
    R().notify(this);
    return Unit{};
  });
}
void Notification::WaitForNotification() const {
  const bool outermost = library_depth == 0;
  InLibrary([&] {
    R().wait_notification(this);
    return Unit{};
  });
  if (outermost) __tsan_acquire(const_cast<Notification*>(this));
}
bool Notification::WaitForNotificationWithTimeout(Duration timeout) const {
  const bool outermost = library_depth == 0;
  const bool notified =
      InLibrary([&] { return R().wait_notification_timeout(this, timeout); });
  if (outermost && notified) __tsan_acquire(const_cast<Notification*>(this));
  return notified;
}
bool Notification::WaitForNotificationWithDeadline(Time deadline) const {
  const bool outermost = library_depth == 0;
  const bool notified = InLibrary(
      [&] { return R().wait_notification_deadline(this, deadline); });
  if (outermost && notified) __tsan_acquire(const_cast<Notification*>(this));
  return notified;
}

ABSL_NAMESPACE_END
}  // namespace absl

// --- OpenMP -----------------------------------------------------------------

namespace {

struct Region {
  void (*fn)(void*);
  void* data;
  // Separate addresses for the two edges, so that a thread of the team that
  // starts after another has finished is not ordered after it.
  char start, end;
};

// Each thread of the team: acquires what the encountering thread released
// before the region, releases what it did for the encountering thread to
// acquire after it.
void RegionBody(void* arg) {
  Region* region = static_cast<Region*>(arg);
  __tsan_acquire(&region->start);
  region->fn(region->data);
  __tsan_release(&region->end);
}

}  // namespace

extern "C" void GOMP_parallel(void (*fn)(void*), void* data,
                              unsigned num_threads, unsigned flags) {
  using Fn = void (*)(void (*)(void*), void*, unsigned, unsigned);
  static const Fn real = Next<Fn>("GOMP_parallel");
  Region region{fn, data, 0, 0};
  __tsan_release(&region.start);
  real(RegionBody, &region, num_threads, flags);
  __tsan_acquire(&region.end);
}
