#include "common/rto_estimator.h"

#include <algorithm>

namespace karat {

RtoEstimator::RtoEstimator(absl::Duration initial, absl::Duration min,
                           absl::Duration max)
    : initial_(initial), min_(min), max_(std::max(min, max)) {}

void RtoEstimator::Sample(absl::Duration r) {
  if (r < absl::ZeroDuration()) r = absl::ZeroDuration();
  if (samples_++ == 0) {
    srtt_ = r;
    rttvar_ = r / 2;
    return;
  }
  rttvar_ = rttvar_ * 3 / 4 + absl::AbsDuration(srtt_ - r) / 4;
  srtt_ = srtt_ * 7 / 8 + r / 8;
}

absl::Duration RtoEstimator::rto() const {
  const absl::Duration r = samples_ == 0 ? initial_ : srtt_ + 4 * rttvar_;
  return std::clamp(r, min_, max_);
}

absl::Duration RtoEstimator::Backoff(int sends) const {
  absl::Duration r = rto();
  for (int i = 1; i < sends && r < max_; ++i) r *= 2;
  return std::min(r, max_);
}

}  // namespace karat
