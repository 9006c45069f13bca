target_sources(karat_common PRIVATE
  common/kv_store.cc
  common/attention.cc
  common/core_pool.cc
  common/model_runner.cc
  common/reference_engine.cc)
