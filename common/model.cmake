target_sources(karat_common PRIVATE
  common/kv_store.cc
  common/attention.cc
  common/attention_indexer.cc
  common/attention_indexer_rows.cc
  common/attention_indexer_tiles.cc
  common/attention_indexer_vector.cc
  common/attention_mla.cc
  common/attention_mla_tiles.cc
  common/attention_topk.cc
  common/core_pool.cc
  common/model_runner.cc
  common/model_runner_experts.cc
  common/model_runner_step.cc
  common/local_attention_backend.cc
  common/reference_engine.cc)
