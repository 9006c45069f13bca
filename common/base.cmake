target_sources(karat_common PRIVATE common/log.cc)
