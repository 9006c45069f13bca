// Retransmission of MoE dispatches (gpu_node/expert_parallel.h): how long a
// dispatching rank waits for a peer's combine before it sends the dispatch
// again. Pure logic on explicit times; the caller serialises access.
//
// RttEstimator is RFC 6298's estimator of one peer's answer time (from a
// dispatch's send to its combine: transfer both ways, the peer's queue and
// its computation): srtt and rttvar from the samples, RTO = srtt + 4 *
// rttvar clamped to [min, max], `initial` before the first sample. A timer
// that expires doubles the RTO of its request (at most `max`), and the
// peer's RTO for new requests stays at least that until a valid sample
// comes (RFC 6298 5.5-5.7). Karn's rule: only a request sent once gives a
// sample, since the answer to one sent twice may answer either copy.
//
// RetransmitTimer is one request's schedule. Its timer runs from the
// transport's report that the send completed (no resend while the last
// copy is still with the transport: it is not lost yet); a send that
// fails, at once or later, is tried again one RTO after the failure. Each
// resend doubles the request's RTO. So loss costs about one RTO per lost
// frame, and a link that is down for T seconds is retried at RTO, 2 RTO,
// 4 RTO, ... (at most `max` apart): the request goes through within about
// `max` of the link coming back.
#pragma once

#include <cstdint>
#include <optional>

#include "absl/time/time.h"

namespace karat {

struct RtoBounds {
  // Before the first sample of a peer.
  absl::Duration initial = absl::Milliseconds(200);
  absl::Duration min = absl::Milliseconds(5);
  absl::Duration max = absl::Seconds(1);
  // min > 0 (else 1 ms), max >= min, initial within [min, max].
  RtoBounds Sanitized() const;
};

class RttEstimator {
 public:
  explicit RttEstimator(const RtoBounds& bounds = {});

  // An answer time of a request that was sent once (never one sent again).
  // Ends a back-off.
  void AddSample(absl::Duration rtt);
  // A request's timer expired with `rto` (it is sent again): its next RTO,
  // 2 * rto at most `max`, which new requests to the peer also get until
  // the next sample.
  absl::Duration Backoff(absl::Duration rto);
  // The RTO for a new request.
  absl::Duration rto() const;

  bool has_sample() const { return samples_ > 0; }
  int64_t samples() const { return samples_; }
  absl::Duration srtt() const { return srtt_; }
  absl::Duration rttvar() const { return rttvar_; }
  const RtoBounds& bounds() const { return bounds_; }

 private:
  RtoBounds bounds_;
  int64_t samples_ = 0;
  absl::Duration srtt_;
  absl::Duration rttvar_;
  absl::Duration backed_off_;  // zero: none
};

class RetransmitTimer {
 public:
  // `rto`: the peer's RTO when the request is made.
  explicit RetransmitTimer(absl::Duration rto);

  // A copy is handed to the transport at `now`; its outcome follows with
  // OnCompleted, OnFailed or OnRefused.
  void OnPosting(absl::Time now);
  // The transport took the copy but refused it at once (it never left).
  void OnRefused(absl::Time now);
  // The copy left: the timer runs from `now`.
  void OnCompleted(absl::Time now);
  // The transport reports the copy failed: tried again one RTO from `now`.
  void OnFailed(absl::Time now);
  // Whether a copy is due at `now`: none with the transport, and the
  // timer expired.
  bool Due(absl::Time now) const { return !in_flight_ && now >= due_; }
  // When the next copy is due; InfiniteFuture while one is with the
  // transport.
  absl::Time due() const;
  // The timer expired and a copy is sent again: the RTO doubles
  // (`peer`'s back-off too, RttEstimator::Backoff).
  void OnExpired(RttEstimator* peer);
  // The answer came at `now`: the sample for the peer's estimator when
  // exactly one copy left (Karn's rule), else nullopt.
  std::optional<absl::Duration> Sample(absl::Time now) const;

  absl::Duration rto() const { return rto_; }
  // Copies handed to the transport, refused ones included.
  int attempts() const { return attempts_; }
  // Copies that may have reached the peer (not refused at once).
  int posts() const { return posts_; }
  bool in_flight() const { return in_flight_; }

 private:
  absl::Duration rto_;
  absl::Time due_ = absl::InfiniteFuture();
  absl::Time first_post_;  // of the first copy that was not refused
  bool in_flight_ = false;
  int attempts_ = 0;
  int posts_ = 0;
};

}  // namespace karat
