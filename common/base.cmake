target_sources(karat_common PRIVATE common/log.cc common/log_limiter.cc)
