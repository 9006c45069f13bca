target_sources(karat_common PRIVATE common/linear.cc)
