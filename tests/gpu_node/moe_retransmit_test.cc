// The MoE dispatch retransmission logic on explicit times: the RTO
// estimator (RFC 6298 with Karn's rule and a persisting back-off) and one
// request's timer.
#include "gpu_node/moe_retransmit.h"

#include <catch2/catch.hpp>

namespace karat {
namespace {

using absl::Milliseconds;

RtoBounds Bounds() {
  RtoBounds b;
  b.initial = Milliseconds(200);
  b.min = Milliseconds(5);
  b.max = absl::Seconds(1);
  return b;
}

TEST_CASE("the RTO starts at the initial value and follows srtt + 4 rttvar",
          "[moe_retransmit]") {
  RttEstimator e(Bounds());
  CHECK_FALSE(e.has_sample());
  CHECK(e.rto() == Milliseconds(200));
  // First sample: srtt = R, rttvar = R / 2, RTO = 3 R.
  e.AddSample(Milliseconds(20));
  CHECK(e.srtt() == Milliseconds(20));
  CHECK(e.rttvar() == Milliseconds(10));
  CHECK(e.rto() == Milliseconds(60));
  // rttvar = (3 * 10 + |20 - 28|) / 4 = 9.5; srtt = (7 * 20 + 28) / 8 = 21.
  e.AddSample(Milliseconds(28));
  CHECK(e.rttvar() == absl::Microseconds(9500));
  CHECK(e.srtt() == Milliseconds(21));
  CHECK(e.rto() == Milliseconds(59));
  CHECK(e.samples() == 2);
  // Steady answers shrink the variance, and the RTO towards srtt.
  for (int i = 0; i < 100; ++i) e.AddSample(Milliseconds(21));
  CHECK(e.rto() < Milliseconds(22));
  CHECK(e.rto() >= Milliseconds(21));
}

TEST_CASE("the RTO is clamped to its bounds", "[moe_retransmit]") {
  RttEstimator fast(Bounds());
  fast.AddSample(absl::Microseconds(100));
  CHECK(fast.rto() == Milliseconds(5));
  RttEstimator slow(Bounds());
  slow.AddSample(absl::Seconds(2));
  CHECK(slow.rto() == absl::Seconds(1));
  // Nonsense bounds are made sane: min > 0, max >= min, initial within.
  RtoBounds odd;
  odd.min = absl::ZeroDuration();
  odd.max = absl::ZeroDuration();
  odd.initial = absl::Seconds(9);
  const RtoBounds sane = odd.Sanitized();
  CHECK(sane.min == Milliseconds(1));
  CHECK(sane.max == Milliseconds(1));
  CHECK(sane.initial == Milliseconds(1));
}

TEST_CASE("a back-off doubles up to the bound and holds until a sample",
          "[moe_retransmit]") {
  RttEstimator e(Bounds());
  e.AddSample(Milliseconds(10));  // RTO 30 ms
  REQUIRE(e.rto() == Milliseconds(30));
  CHECK(e.Backoff(Milliseconds(30)) == Milliseconds(60));
  // New requests start from the backed-off value...
  CHECK(e.rto() == Milliseconds(60));
  // ...and a smaller back-off (an older request's) does not lower it.
  CHECK(e.Backoff(Milliseconds(20)) == Milliseconds(40));
  CHECK(e.rto() == Milliseconds(60));
  CHECK(e.Backoff(Milliseconds(700)) == absl::Seconds(1));
  CHECK(e.rto() == absl::Seconds(1));
  // A valid sample ends the back-off.
  e.AddSample(Milliseconds(10));
  CHECK(e.rto() < Milliseconds(60));
}

TEST_CASE("a request's timer runs from the send's completion",
          "[moe_retransmit]") {
  const absl::Time t0 = absl::UnixEpoch();
  RttEstimator peer(Bounds());
  RetransmitTimer timer(peer.rto());  // 200 ms
  timer.OnPosting(t0);
  // Still with the transport: never due.
  CHECK_FALSE(timer.Due(t0 + absl::Seconds(10)));
  CHECK(timer.due() == absl::InfiniteFuture());
  timer.OnCompleted(t0 + Milliseconds(50));
  CHECK(timer.due() == t0 + Milliseconds(250));
  CHECK_FALSE(timer.Due(t0 + Milliseconds(249)));
  CHECK(timer.Due(t0 + Milliseconds(250)));
  // Answered without a resend: a sample from the post.
  REQUIRE(timer.Sample(t0 + Milliseconds(80)).has_value());
  CHECK(*timer.Sample(t0 + Milliseconds(80)) == Milliseconds(80));
}

TEST_CASE("a resent request doubles its RTO and gives no sample (Karn)",
          "[moe_retransmit]") {
  const absl::Time t0 = absl::UnixEpoch();
  RttEstimator peer(Bounds());
  peer.AddSample(Milliseconds(10));  // RTO 30 ms
  RetransmitTimer timer(peer.rto());
  timer.OnPosting(t0);
  timer.OnCompleted(t0);
  REQUIRE(timer.Due(t0 + Milliseconds(30)));
  timer.OnExpired(&peer);
  CHECK(timer.rto() == Milliseconds(60));
  CHECK(peer.rto() == Milliseconds(60));  // the peer backs off too
  timer.OnPosting(t0 + Milliseconds(30));
  timer.OnCompleted(t0 + Milliseconds(30));
  CHECK(timer.due() == t0 + Milliseconds(90));
  CHECK(timer.attempts() == 2);
  CHECK(timer.posts() == 2);
  // The combine may answer either copy: no sample, so the estimate is not
  // poisoned; the peer's RTO stays backed off.
  CHECK_FALSE(timer.Sample(t0 + Milliseconds(95)).has_value());
  CHECK(peer.rto() == Milliseconds(60));
}

TEST_CASE("failed sends are retried one RTO later, backing off",
          "[moe_retransmit]") {
  const absl::Time t0 = absl::UnixEpoch();
  RttEstimator peer(Bounds());
  peer.AddSample(Milliseconds(100));  // RTO 300 ms
  RetransmitTimer timer(peer.rto());
  // A link that is down: every send refused at once.
  absl::Time now = t0;
  std::vector<absl::Duration> gaps;
  for (int i = 0; i < 6; ++i) {
    timer.OnPosting(now);
    timer.OnRefused(now);
    const absl::Time next = timer.due();
    gaps.push_back(next - now);
    now = next;
    REQUIRE(timer.Due(now));
    timer.OnExpired(&peer);
  }
  CHECK(gaps == std::vector<absl::Duration>{
                    Milliseconds(300), Milliseconds(600), absl::Seconds(1),
                    absl::Seconds(1), absl::Seconds(1), absl::Seconds(1)});
  CHECK(timer.posts() == 0);
  CHECK(timer.attempts() == 6);
  // The link is back: the copy that goes through is the only one that can
  // have reached the peer, so its answer is a valid sample.
  timer.OnPosting(now);
  timer.OnCompleted(now);
  REQUIRE(timer.Sample(now + Milliseconds(40)).has_value());
  CHECK(*timer.Sample(now + Milliseconds(40)) == Milliseconds(40));

  // A send that failed after leaving may have arrived: a later copy's
  // answer is no sample.
  RetransmitTimer late(Milliseconds(50));
  late.OnPosting(t0);
  late.OnFailed(t0 + Milliseconds(10));
  CHECK(late.due() == t0 + Milliseconds(60));
  late.OnExpired(&peer);
  late.OnPosting(t0 + Milliseconds(60));
  late.OnCompleted(t0 + Milliseconds(60));
  CHECK_FALSE(late.Sample(t0 + Milliseconds(70)).has_value());
}

}  // namespace
}  // namespace karat
