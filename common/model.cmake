target_sources(karat_common PRIVATE
  common/kv_store.cc
  common/attention.cc
  common/core_pool.cc
  common/model_runner.cc
  common/model_runner_experts.cc
  common/model_runner_step.cc
  common/local_attention_backend.cc
  common/reference_engine.cc)
