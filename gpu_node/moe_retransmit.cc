#include "gpu_node/moe_retransmit.h"

#include <algorithm>

namespace karat {

RtoBounds RtoBounds::Sanitized() const {
  RtoBounds b = *this;
  if (b.min <= absl::ZeroDuration()) b.min = absl::Milliseconds(1);
  b.max = std::max(b.max, b.min);
  b.initial = std::clamp(b.initial, b.min, b.max);
  return b;
}

RttEstimator::RttEstimator(const RtoBounds& bounds)
    : bounds_(bounds.Sanitized()) {}

void RttEstimator::AddSample(absl::Duration rtt) {
  rtt = std::max(rtt, absl::ZeroDuration());
  if (samples_ == 0) {
    srtt_ = rtt;
    rttvar_ = rtt / 2;
  } else {
    // beta = 1/4, alpha = 1/8 (RFC 6298 2.3); rttvar first, with the old
    // srtt.
    rttvar_ = (rttvar_ * 3 + absl::AbsDuration(srtt_ - rtt)) / 4;
    srtt_ = (srtt_ * 7 + rtt) / 8;
  }
  ++samples_;
  backed_off_ = absl::ZeroDuration();
}

absl::Duration RttEstimator::Backoff(absl::Duration rto) {
  const absl::Duration next = std::clamp(rto * 2, bounds_.min, bounds_.max);
  backed_off_ = std::max(backed_off_, next);
  return next;
}

absl::Duration RttEstimator::rto() const {
  absl::Duration base = bounds_.initial;
  if (samples_ > 0) {
    base = std::clamp(srtt_ + rttvar_ * 4, bounds_.min, bounds_.max);
  }
  return std::max(base, backed_off_);
}

RetransmitTimer::RetransmitTimer(absl::Duration rto) : rto_(rto) {}

void RetransmitTimer::OnPosting(absl::Time now) {
  in_flight_ = true;
  ++attempts_;
  // Counted before the transport answers: the answer to this copy may
  // come before the send call returns.
  if (posts_++ == 0) first_post_ = now;
}

void RetransmitTimer::OnRefused(absl::Time now) {
  --posts_;
  OnFailed(now);
}

void RetransmitTimer::OnCompleted(absl::Time now) {
  in_flight_ = false;
  due_ = now + rto_;
}

void RetransmitTimer::OnFailed(absl::Time now) {
  in_flight_ = false;
  due_ = now + rto_;
}

absl::Time RetransmitTimer::due() const {
  return in_flight_ ? absl::InfiniteFuture() : due_;
}

void RetransmitTimer::OnExpired(RttEstimator* peer) {
  rto_ = peer->Backoff(rto_);
}

std::optional<absl::Duration> RetransmitTimer::Sample(absl::Time now) const {
  if (posts_ != 1) return std::nullopt;
  return now - first_post_;
}

}  // namespace karat
