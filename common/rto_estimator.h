// The retransmission timeout of requests answered over the data plane
// (README "Data plane", lossy links): Jacobson and Karels' estimate of the
// answer time (smoothed mean srtt and mean deviation rttvar, gains 1/8 and
// 1/4) and rto = srtt + 4 rttvar, clamped, as TCP computes it (RFC 6298).
// Only answers to requests sent once are samples (Karn): the answer to a
// resent request may be the first copy's. Each further resend of one
// request doubles its wait (Backoff). Not thread-safe; pure arithmetic.
#pragma once

#include "absl/time/time.h"

namespace karat {

class RtoEstimator {
 public:
  // `initial` until the first sample; every rto is clamped to [min, max].
  RtoEstimator(absl::Duration initial, absl::Duration min, absl::Duration max);

  void Sample(absl::Duration answer_time);
  absl::Duration rto() const;
  // How long to wait after the `sends`-th send of one request (1: the
  // first): rto doubled per resend, at most `max`.
  absl::Duration Backoff(int sends) const;
  bool has_samples() const { return samples_ > 0; }
  absl::Duration srtt() const { return srtt_; }

 private:
  const absl::Duration initial_, min_, max_;
  absl::Duration srtt_ = absl::ZeroDuration();
  absl::Duration rttvar_ = absl::ZeroDuration();
  long samples_ = 0;
};

}  // namespace karat
