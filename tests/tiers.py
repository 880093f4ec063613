"""The test tiers (docs/guides/testing.md): what a test starts decides its tier.

- default (`pytest`): unit and module tests; no whole run, no child process, no notebook.
- `integration` (`pytest -m integration`): every test that starts a run (`rl.loop.run`,
  the SFT cold start), a child process (a CLI in a subprocess, a server, a kill test) or
  a notebook kernel; and the tests of 5 s or more (`HEAVY`).
- `slow` and `tpu`: as their markers say (pyproject.toml). `slow` also holds the rest of
  each large parameter product (`SAMPLED`, marked `sampled` too; `integration` holds
  those of `SAMPLED_IN_CI`), so the three tiers together run every case. CI runs no `slow` test (docs/guides/testing.md);
  `BEYOND_CI` (marked `beyond_ci`) names the longest of them.

`guarded` (conftest.py's pytest_runtest_protocol) fails a default-tier test that starts
any of these, in its body or in a fixture it sets up, so a test cannot land in the wrong
tier unnoticed.
"""
import multiprocessing.process
import random
import re
import subprocess

import pytest

# Markers whose tests may start runs and processes.
STARTERS = frozenset({"integration", "slow", "tpu"})


# Sampled products whose other cases stay in `integration` (and so in CI): between them
# they run lines of the Hugging Face loader and validator, the rollout-file reader, the
# Pallas fused log-prob and the grouped-matmul table that no other CI test runs
# (`pytest-cov`, docs/guides/testing.md).
SAMPLED_IN_CI = (
    "tests/interop/bad_hf_input_test.py::test_bad_hf_weights_are_refused_naming_tensor_and_file",
    "tests/bad_file_input_test.py::test_hostile_rollout_files_are_one_line_naming_the_file",
    "tests/kernels/fused_logprob_test.py::test_random_shapes_match_float64_reference",
    "tests/kernels/fused_logprob_test.py::test_an_invariant_row_scores_a_token_as_its_distribution_does_in_any_batch",
    "tests/kernels/fused_logprob_test.py::test_value_and_vjp_match_float64_reference",
    "tests/kernels/gmm_pallas_test.py::test_value_and_grads_equal_reference",
    "tests/kernels/gmm_test.py::test_every_implementation_in_the_table_equals_the_loop",
    "tests/kernels/gmm_test.py::test_value_and_grad_match_reference",
    "tests/interop/hf_checkpoint_test.py::test_save_then_load_is_bit_exact",
    "tests/interop/hf_export_test.py::test_the_export_serves_the_sources_template_stop_ids_and_model",
    "tests/interop/hf_parity_test.py::test_logits_and_experts_match_transformers",
    "tests/model/invariant_test.py::test_a_grouped_tile_row_ignores_the_rest_of_its_group",
    "tests/model/invariant_test.py::test_an_exchanged_expert_row_is_one_devices",
)

# Parameter products whose default-tier run is one fixed-seed case (`sampled_out`); the
# `slow` tier runs the other cases (marked `sampled`), `integration` those of
# SAMPLED_IN_CI. Each product here took over 4 s in all.
SAMPLED = SAMPLED_IN_CI + (
    "tests/rl/accumulate_test.py::test_accumulated_losses_equal_one_batch",
    "tests/interop/bad_hf_input_test.py::test_a_hostile_chat_template_is_one_line_naming_its_file",
    "tests/sampling/continuous_test.py::test_continuous_matches_static_across_layouts_and_numerics",
    "tests/sampling/continuous_test.py::test_continuous_returns_the_static_rollout_bit_for_bit",
    "tests/kernels/decode_attention_test.py::test_every_row_is_the_reference",
    "tests/kernels/decode_attention_test.py::test_the_samplers_draw_the_same_responses_with_the_kernel",
    "tests/model/expert_parallel_test.py::test_decode_exchange_equals_the_gathered_tokens",
    "tests/method/logprobs_test.py::test_row_does_not_depend_on_other_rows_bitwise",
    "tests/config/loss_table_test.py::test_a_row_lists_exactly_the_knobs_its_loss_reads",
    "tests/method/losses_test.py::HandDerivedTest::test_cispo_by_hand",
    "tests/method/losses_test.py::HandDerivedTest::test_grpo_and_dapo_by_hand",
    "tests/method/losses_test.py::HandDerivedTest::test_gspo_by_hand",
    "tests/method/losses_test.py::HandDerivedTest::test_minirl_ablations_by_hand",
    "tests/method/losses_test.py::test_every_loss_takes_the_row_denominator",
    "tests/rl/packing_test.py::test_plan_is_first_fit_decreasing_whole_and_within_its_shard",
    "tests/model/transformer_test.py::ForwardTest::test_replaying_own_routes_is_bit_identical_and_other_routes_differ",
    "tests/model/transformer_test.py::test_dense_dispatch_and_unrolled_layers_agree_with_the_scan",
    "tests/model/transformer_test.py::test_grouped_matmul_implementations_agree_in_the_model",
    "tests/model/transformer_test.py::test_kv_cache_prefill_then_decode_equals_full_forward",
)

# Tests (or whole parameter products, by name) of 5 s or more each on 2 cores: most
# compile whole-model programs (a model forward and backward in float64, a sampler, a
# score or update step, often two of them to compare), others run a Pallas kernel in the
# interpreter, an op-by-op (`__without_jit`) variant, or build a Hugging Face checkpoint
# or tokenizer fixture. The default tier's five minutes cannot hold them beside the
# rest; the integration tier runs them. Measured with `pytest --durations=0` on a fresh
# clone (docs/guides/testing.md).
HEAVY = (
    "tests/rl/drift_test.py::test_at_zero_mismatch_the_drift_is_zero_and_centring_is_an_exact_no_op",
    "tests/rl/drift_test.py::test_with_fp8_weights_each_source_lands_in_its_own_part_and_only_there",
    "tests/rl/step_fns_test.py::test_learning_rates_share_one_compiled_update_and_each_takes_its_own_step",
    "tests/rl/step_fns_test.py::test_loop_only_names_every_field_no_step_reads",
    "tests/model/expert_parallel_test.py::test_expert_parallel_never_gathers_expert_weights_over_the_expert_axis",
    "tests/sampling/continuous_test.py::test_continuous_matches_static_across_layouts_and_numerics[variant1]",
    "tests/method/overlong_test.py::test_masked_truncated_rows_leave_the_loss",
    "tests/sampling/rollout_test.py::test_any_stop_id_ends_a_row",
    "tests/rl/dynamic_sampling_test.py::test_padded_groups_are_empty_responses_that_carry_no_loss",
    "tests/rl/step_fns_test.py::test_weight_replay_carries_the_samplers_weights_into_score_and_update",
    "tests/model/numerics_test.py::test_prepare_params_converts_once_per_preset",
    "tests/kernels/gmm_pallas_test.py::test_random_groups_and_dtypes",
    "tests/rl/step_fns_test.py::test_trimmed_rollout_scores_and_updates_like_the_padded_one",
    "tests/method/attribution_test.py::test_under_partial_rollouts_each_tokens_terms_come_from_its_version",
    "tests/method/attribution_test.py::test_the_parts_add_up_to_the_total_per_token_and_in_every_moment",
    "tests/kernels/decode_attention_test.py::test_on_a_mesh_each_device_runs_the_kernel_on_its_own_rows",
    "tests/kernels/token_attention_test.py::test_a_querys_output_is_the_same_in_any_call",
    "tests/sampling/serve_layout_test.py::test_serve_layout_samples_what_the_train_layout_samples[fp8-float32-True-0]",
    "tests/rl/step_fns_test.py::test_score_in_update_equals_a_separate_score_pass[r2-2]",
    "tests/method/logprobs_test.py::test_temperature_scales_logits_in_value_and_gradient",
    "tests/rl/adversarial_test.py::test_no_adversarial_batch_reaches_the_parameters",
    "tests/method/losses_first_order_test.py::test_one_token_responses_need_the_is_weight_to_be_exact",
    "tests/rl/accumulate_test.py::test_accumulated_rl_update_equals_one_batch",
    "tests/model/moe_test.py::test_grouped_is_dropless_when_all_tokens_pick_one_expert",
    "tests/sampling/continuous_test.py::test_carried_responses_record_mu_and_routes_of_the_version_that_drew_each_token",
    "tests/method/attribution_test.py::test_under_r3_the_routing_part_is_zero_and_the_counterfactual_is_not",
    "tests/model/transformer_test.py::ForwardTest::test_causality_gradient_from_future_tokens_is_exactly_zero__with_jit",
    "tests/rl/step_fns_test.py::test_update_takes_one_step_and_skips_non_finite",
    "tests/rl/accumulate_test.py::test_engine_microbatches_take_the_same_step",
    "tests/method/logprobs_test.py::test_policy_logprobs_shifts_the_frame_once",
    "tests/rl/step_fns_test.py::test_score_builds_the_update_batch_with_its_replay",
    "tests/method/attribution_test.py::test_at_theta_old_the_total_is_the_score_steps_mismatch_and_staleness_is_zero",
    "tests/model/moe_test.py::test_plan_counts_and_sorts_to_the_same_rows",
    "tests/model/transformer_test.py::test_logits_and_tied_embeddings",
    "tests/sampling/continuous_test.py::test_float32_engine_samples_the_same_tokens_and_routes",
    "tests/sharding_test.py::test_sharded_forward_and_grad_equal_unsharded",
    "tests/model/numerics_test.py::test_exact_is_train_and_presets_order_the_error",
    "tests/runs/trackers_test.py::test_mlflow_resume_continues_the_run_and_logs_each_step_once",
    "tests/model/transformer_test.py::test_padding_never_influences_real_positions",
    "tests/method/attribution_test.py::test_a_layer_whose_routes_alone_differ_carries_the_whole_routing_part",
    "tests/sampling/rollout_test.py::test_rows_are_batch_and_padding_invariant",
    "tests/interop/rollouts_test.py::test_our_rollouts_survive_the_file_round_trip_and_score_the_same",
    "tests/model/moe_test.py::test_router_gradient_reaches_replayed_expert_outside_top_k",
    "tests/model/transformer_test.py::test_input_errors",
    "tests/rl/accumulate_test.py::test_accumulated_sft_update_equals_one_batch",
    "tests/method/losses_test.py::test_row_denominator_under_micro_batches_and_packing",
    "tests/method/losses_first_order_test.py::test_token_surrogate_is_first_order_approximation_of_sequence_objective",
    "tests/interop/parity_test.py::test_a_good_checkpoint_is_within_the_float32_bound",
    "tests/method/mismatch_test.py::test_mismatch_is_ordered_exact_bf16_fp8",
    "tests/method/mismatch_test.py::test_exact_engine_has_no_mismatch",
    "tests/model/moe_test.py::test_router_stats_by_hand",
    "tests/rl/step_fns_test.py::test_an_update_whose_result_is_not_finite_is_skipped_sft_too",
    "tests/interop/parity_test.py::test_a_loader_that_reads_a_square_weight_transposed_fails",
    "tests/kernels/kernel_table_test.py::test_a_new_row_runs_through_the_model",
    "tests/method/attribution_test.py::test_with_the_training_numerics_in_the_sampler_the_precision_part_vanishes",
    "tests/rl/step_fns_test.py::test_sampler_with_its_own_dense_dispatch_samples_like_the_grouped_one",
    "tests/sampling/rollout_test.py::test_a_model_forced_to_emit_a_second_stop_id_stops_there",
    "tests/rl/accumulate_test.py::test_score_and_sampler_slices_equal_one_pass",
    "tests/rl/step_fns_test.py::test_update_ascends_the_advantage_weighted_log_likelihood",
    "tests/rl/packing_test.py::test_a_tokens_logprob_does_not_depend_on_what_is_packed_beside_it",
    "tests/rl/inflight_test.py::test_behavior_score_takes_each_tokens_pi_old_from_its_version",
    "tests/model/transformer_test.py::test_chunked_attention_equals_naive",
    "tests/model/moe_test.py::test_dense_local_experts_equal_the_grouped_shard",
    "tests/rl/packing_test.py::test_packed_score_and_update_equal_the_padded_ones",
    "tests/method/attribution_test.py::test_the_bins_partition_the_scored_tokens",
    "tests/model/moe_test.py::test_dense_and_grouped_agree_in_value_and_gradient",
    "tests/sampling/serve_layout_test.py::test_serve_decode_loop_gathers_no_weight_and_moves_only_activations",
    "tests/model/transformer_test.py::test_remat_equal_values_and_gradients",
    "tests/model/expert_parallel_test.py::test_sharded_experts_equal_unsharded",
    "tests/method/attribution_test.py::test_the_layer_shares_and_the_interaction_add_to_one",
    "tests/rl/accumulate_test.py::test_accumulated_losses_equal_one_batch[gspo]",
    "tests/interop/bad_hf_input_test.py::test_bad_hf_weights_are_refused_naming_tensor_and_file[nan]",
    "tests/bad_library_input_test.py::test_loss_batch_values_and_emptiness",
    "tests/bad_library_input_test.py::test_value_checks_under_jit_through_checkify",
    "tests/runs/checkpoint_test.py::test_restore_lands_on_target_shardings",
    "tests/experiments/coldstart_hf_test.py::test_dry_run_shows_the_checkpoint_architecture",
    "tests/sampling/continuous_test.py::test_continuous_returns_the_static_rollout_bit_for_bit[1]",
    "tests/sampling/continuous_test.py::test_slots_given_to_run_override_max_batch",
    "tests/kernels/decode_attention_test.py::test_every_row_is_the_reference[True-pallas_tpu]",
    "tests/kernels/decode_attention_test.py::test_the_samplers_draw_the_same_responses_with_the_kernel[static]",
    "tests/method/diagnostics_test.py::test_first_order_residual_by_hand_and_stable",
    "tests/method/diagnostics_test.py::test_pairs_accumulate_exactly_and_jit_with_numpy",
    "tests/model/expert_parallel_test.py::test_decode_exchange_equals_the_gathered_tokens[32-False]",
    "tests/kernels/fused_logprob_test.py::test_chunked_check_grads_x64",
    "tests/kernels/fused_logprob_test.py::test_naive_reference_is_the_float32_formula",
    "tests/kernels/fused_logprob_test.py::test_random_shapes_match_float64_reference[pallas_gpu]",
    "tests/kernels/fused_logprob_test.py::test_shape_errors_name_values",
    "tests/kernels/fused_logprob_test.py::test_value_and_vjp_match_float64_reference[shape2-bfloat16-chunked]",
    "tests/fuzz_files_test.py::test_hf_config_json[fast]",
    "tests/runs/gcs_bad_input_test.py::test_an_endpoint_refusing_connections_is_one_line_within_the_bound",
    "tests/kernels/gmm_pallas_test.py::test_value_and_grads_equal_reference[sizes3-gpu]",
    "tests/kernels/gmm_test.py::test_every_implementation_in_the_table_equals_the_loop[pallas_tpu]",
    "tests/kernels/gmm_test.py::test_value_and_grad_match_reference[sizes3-loop]",
    "tests/interop/hf_checkpoint_test.py::test_a_hostile_shard_index_is_refused_naming_it[a shard that is config.json-config.json: not a readable safetensors file]",
    "tests/interop/hf_checkpoint_test.py::test_every_model_field_is_read_from_config_json_or_kept",
    "tests/interop/hf_export_test.py::test_the_export_serves_the_sources_template_stop_ids_and_model[jinja]",
    "tests/interop/hf_parity_test.py::test_logits_and_experts_match_transformers[3-True-False]",
    "tests/interop/hf_parity_test.py::test_our_saved_checkpoint_loads_in_transformers[per_expert]",
    "tests/hostile_files_test.py::test_a_hostile_tokenizer_json_is_one_line_at_the_command_line",
    "tests/hostile_files_test.py::test_the_limits_hold_real_qwen_and_llama_tokenizers",
    "tests/rl/inflight_test.py::test_stale_responses_are_dropped_and_redrawn_with_a_new_key",
    "tests/model/invariant_test.py::test_a_tile_body_gives_a_row_the_same_bits_wherever_it_sits[bfloat16]",
    "tests/model/invariant_test.py::test_a_tile_body_gives_a_row_the_same_bits_wherever_it_sits[float32]",
    "tests/model/invariant_test.py::test_an_expert_row_crosses_the_mesh_unchanged[bfloat16]",
    "tests/model/invariant_test.py::test_an_expert_row_crosses_the_mesh_unchanged[float32]",
    "tests/model/invariant_test.py::test_skipped_and_masked_key_blocks_change_nothing",
    "tests/method/logprobs_test.py::test_row_does_not_depend_on_other_rows_bitwise[pallas_gpu]",
    "tests/config/loss_table_test.py::test_a_row_lists_exactly_the_knobs_its_loss_reads[gspo]",
    "tests/method/losses_inputs_test.py::test_jits_with_numpy_inputs",
    "tests/method/losses_inputs_test.py::test_minibatch_metrics_reduce_to_the_full_batch",
    "tests/method/losses_inputs_test.py::test_non_finite_old_logp_on_a_real_token_makes_the_loss_nan",
    "tests/method/losses_test.py::HandDerivedTest::test_cispo_by_hand__without_jit",
    "tests/method/losses_test.py::HandDerivedTest::test_grpo_and_dapo_by_hand__without_jit",
    "tests/method/losses_test.py::HandDerivedTest::test_gspo_by_hand__without_jit",
    "tests/method/losses_test.py::test_aggregations_by_hand",
    "tests/method/losses_test.py::test_every_loss_takes_the_row_denominator[gspo]",
    "tests/method/losses_test.py::test_is_corrections_by_hand",
    "tests/method/losses_test.py::test_row_denominator_by_hand",
    "tests/method/mismatch_test.py::test_measured_at_the_sampling_temperature",
    "tests/method/mismatch_test.py::test_shifted_logp_gives_hand_derived_kl",
    "tests/model/moe_test.py::test_route_replay_by_hand_with_minus_one_rows",
    "tests/model/moe_test.py::test_weight_replay_uses_the_recorded_weights_and_stops_their_gradient",
    "tests/model/numerics_test.py::test_fake_quant_values_are_e4m3_times_channel_scale",
    "tests/model/numerics_test.py::test_knobs_increase_mismatch",
    "tests/rl/packing_test.py::test_plan_is_first_fit_decreasing_whole_and_within_its_shard[1]",
    "tests/sampling/rollout_test.py::test_exact_preset_matches_training_path",
    "tests/sampling/rollout_test.py::test_kv_cache_layouts_sample_the_same_rows[False]",
    "tests/sampling/rollout_test.py::test_truncation_support",
    "tests/interop/rollouts_test.py::test_files_that_cannot_feed_the_run_are_refused",
    "tests/experiments/routing_fixes_test.py::test_expert_load_counts_equal_a_one_hot_count",
    "tests/experiments/routing_fixes_test.py::test_expert_load_monitors_by_hand",
    "tests/experiments/routing_fixes_test.py::test_indices_only_replay_takes_the_live_routers_weights",
    "tests/pod/schedule_test.py::test_train_shares_of_padded_and_packed_steps_by_hand",
    "tests/rl/step_fns_test.py::test_r2_on_policy_first_minibatch_is_bit_identical_to_no_replay",
    "tests/rl/step_fns_test.py::test_runs_that_differ_only_in_loop_fields_share_their_jitted_steps",
    "tests/rl/step_fns_test.py::test_score_in_update_is_ignored_with_several_minibatches",
    "tests/model/transformer_test.py::ForwardTest::test_replaying_own_routes_is_bit_identical_and_other_routes_differ__without_jit",
    "tests/model/transformer_test.py::test_dense_dispatch_and_unrolled_layers_agree_with_the_scan[variant1]",
    "tests/model/transformer_test.py::test_grouped_matmul_implementations_agree_in_the_model[tiles]",
    "tests/model/transformer_test.py::test_kv_cache_prefill_then_decode_equals_full_forward[bskd-True-0]",
    "tests/method/mismatch_test.py::test_flipped_routes_give_hand_derived_rates",
    "tests/config/loss_table_test.py::test_the_row_aggregation_is_the_default[minirl]",
    "tests/method/losses_inputs_test.py::test_masked_tokens_contribute_nothing",
    "tests/method/losses_test.py::HandDerivedTest::test_minirl_ablations_by_hand__without_jit",
    "tests/sampling/continuous_test.py::test_bad_inputs_are_refused_as_by_the_static_sampler",
)


def family(nodeid: str) -> str:
    """A test's name without its parameters ([...]) or chex variant (__with_jit, ...)."""
    return re.sub(r"(__with(out)?_jit|__with_device|__without_device)$", "",
                  re.sub(r"\[.*\]$", "", nodeid))


def sampled_out(nodeids: list[str], k: int = 1, seed: int = 0) -> set[str]:
    """Of the cases of one parameter product, those outside a fixed-seed sample of k."""
    cases = sorted(nodeids)
    keep = set(random.Random(seed).sample(cases, min(k, len(cases))))
    return set(cases) - keep


# Integration-tier products and whole-run tests that CI runs in part: {family: the case
# ids CI keeps}. CI's integration tier (`-m "integration and not slow"`) runs the kept
# cases; the others are marked `slow` and `sampled` (an empty tuple: the whole family).
# Chosen by their time on 2 cores (docs/guides/testing.md, "The budget"); the kept cases
# are those that run lines no other CI test runs (`pytest-cov`, the same measurement as
# the split: the packed, causal-packed and Pallas-on-a-mesh paths).
SAMPLED_IN_INTEGRATION = {
    "tests/model/invariant_test.py::test_a_bitwise_run_records_zero_mismatch": (
        "padded", "packed", "pallas_logprob_partial_mesh"),
    "tests/model/invariant_test.py::test_on_a_mesh_the_sampler_scores_as_the_trainer": (
        "mesh3-train-False-True",),
    "tests/model/invariant_test.py::test_cache_layouts_layer_loops_and_row_tiles_keep_it_bitwise": (
        "kw4",),
    "tests/model/invariant_test.py::test_the_static_sampler_scores_as_the_trainer": (),
    "tests/rl/packing_test.py::test_a_tokens_logprob_does_not_depend_on_what_is_packed_beside_it": (
        "chunked",),
    "tests/rl/packing_test.py::test_packed_score_and_update_equal_the_padded_ones": (
        "minirl-r2-causal",),
    "tests/kernels/token_attention_test.py::test_the_kernel_keeps_the_sampler_bitwise": (
        "static",),
    "tests/kernels/token_attention_test.py::test_a_querys_output_is_the_same_in_any_call": (
        "float32",),
    "tests/kernels/token_attention_test.py::test_a_bitwise_run_with_the_kernel_records_zero_mismatch": (),
    "tests/model/moe_test.py::test_dense_local_experts_equal_the_grouped_shard": ("2",),
}


# Integration tests whose every line other CI tests run, with their per-test line
# coverage (`pytest-cov --cov-context=test` over the three CI tiers; docs/guides/testing.md,
# "Coverage across the split"): CI leaves them to `slow`. Chosen by time on 2 cores, and
# none is CI's only check of a promise made exact (resume, zero mismatch, packed = padded,
# sharded = unsharded): those stay.
LINES_RUN_ELSEWHERE = (
    "tests/sampling/rollout_test.py::test_any_stop_id_ends_a_row",
    "tests/reliability_test.py::test_ctrl_c_during_a_save_ends_the_run_in_bounded_time",
    "tests/rl/accumulate_test.py::test_accumulated_losses_equal_one_batch[gspo]",
    "tests/sampling/serve_layout_test.py::test_serve_decode_loop_gathers_no_weight_and_moves_only_activations",
    "tests/method/overlong_test.py::test_masked_truncated_rows_leave_the_loss",
    "tests/model/moe_test.py::test_grouped_is_dropless_when_all_tokens_pick_one_expert",
    "tests/experiments/experiments_test.py::test_long_preset_smoke",
    "tests/model/moe_test.py::test_dense_and_grouped_agree_in_value_and_gradient[8]",
    "tests/rl/step_fns_test.py::test_trimmed_rollout_scores_and_updates_like_the_padded_one",
    "tests/rl/step_fns_test.py::test_weight_replay_carries_the_samplers_weights_into_score_and_update",
    "tests/method/losses_first_order_test.py::test_one_token_responses_need_the_is_weight_to_be_exact",
    "tests/rl/drift_test.py::test_with_fp8_weights_each_source_lands_in_its_own_part_and_only_there",
    "tests/method/losses_test.py::HandDerivedTest::test_gspo_by_hand__without_jit",
    "tests/method/losses_test.py::HandDerivedTest::test_cispo_by_hand__without_jit",
    "tests/model/transformer_test.py::ForwardTest::test_replaying_own_routes_is_bit_identical_and_other_routes_differ__without_jit",
    "tests/sampling/serve_layout_test.py::test_serve_layout_samples_what_the_train_layout_samples[fp8-float32-True-0]",
    "tests/method/attribution_test.py::test_a_layer_whose_routes_alone_differ_carries_the_whole_routing_part",
    "tests/model/invariant_test.py::test_an_exchanged_expert_row_is_one_devices[loop-float32]",
    "tests/rl/loop_test.py::test_a_continuous_sampler_run_is_the_static_sampler_run",
    "tests/model/numerics_test.py::test_prepare_params_converts_once_per_preset",
    "tests/rl/dynamic_sampling_test.py::test_padded_groups_are_empty_responses_that_carry_no_loss",
    "tests/model/transformer_test.py::test_chunked_attention_equals_naive[chunked-5]",
    "tests/experiments/recipe_test.py::test_the_paper_recipe_runs_on_this_cpu_with_no_layout_override",
    "tests/method/logprobs_test.py::test_temperature_scales_logits_in_value_and_gradient",
    "tests/kernels/gmm_pallas_test.py::test_random_groups_and_dtypes",
    "tests/rl/step_fns_test.py::test_score_in_update_equals_a_separate_score_pass[r2-2]",
    "tests/model/transformer_test.py::test_padding_never_influences_real_positions",
    "tests/model/moe_test.py::test_router_gradient_reaches_replayed_expert_outside_top_k",
    "tests/model/expert_parallel_test.py::test_decode_exchange_equals_the_gathered_tokens[32-False]",
    "tests/rl/step_fns_test.py::test_update_ascends_the_advantage_weighted_log_likelihood",
    "tests/kernels/decode_attention_test.py::test_the_samplers_draw_the_same_responses_with_the_kernel[static]",
    "tests/method/diagnostics_test.py::test_first_order_residual_by_hand_and_stable",
    "tests/model/invariant_test.py::test_a_pallas_fused_logprob_keeps_it_bitwise[continuous]",
    "tests/model/moe_test.py::test_plan_counts_and_sorts_to_the_same_rows",
    "tests/method/attribution_test.py::test_under_r3_the_routing_part_is_zero_and_the_counterfactual_is_not",
    "tests/rl/accumulate_test.py::test_engine_microbatches_take_the_same_step",
    "tests/interop/parity_test.py::test_a_transposed_square_weight_fails_against_the_original",
    "tests/runs/checkpoint_test.py::test_restore_lands_on_target_shardings",
    "tests/method/losses_test.py::test_row_denominator_under_micro_batches_and_packing",
    "tests/method/diagnostics_test.py::test_pairs_accumulate_exactly_and_jit_with_numpy",
    "tests/model/expert_parallel_test.py::test_sharded_experts_equal_unsharded[True]",
    "tests/sampling/continuous_test.py::test_continuous_matches_static_across_layouts_and_numerics[variant1]",
    "tests/rl/costs_test.py::test_the_run_prices_its_programs_with_the_function_aot_compile_prints",
    "tests/method/attribution_test.py::test_at_theta_old_the_total_is_the_score_steps_mismatch_and_staleness_is_zero",
    "tests/experiments/recipe_test.py::test_packed_score_and_update_run_on_the_checkpoint_recipe",
    "tests/model/transformer_test.py::test_logits_and_tied_embeddings",
    "tests/model/invariant_test.py::test_an_exchanged_expert_row_is_one_devices[loop-bfloat16]",
    "tests/sampling/continuous_test.py::test_slots_given_to_run_override_max_batch",
    "tests/sampling/continuous_test.py::test_float32_engine_samples_the_same_tokens_and_routes",
    "tests/experiments/routing_fixes_test.py::test_the_samplers_router_dtype_changes_only_the_routers_arithmetic",
    "tests/model/transformer_test.py::test_remat_equal_values_and_gradients[True-full]",
    "tests/rl/dynamic_sampling_test.py::test_with_every_group_kept_it_is_the_run_without_it",
    "tests/model/moe_test.py::test_route_replay_by_hand_with_minus_one_rows",
    "tests/model/invariant_test.py::test_skipped_and_masked_key_blocks_change_nothing",
    "tests/rl/accumulate_test.py::test_accumulated_sft_update_equals_one_batch",
    "tests/rl/step_fns_test.py::test_an_update_whose_result_is_not_finite_is_skipped_sft_too",
    "tests/method/attribution_test.py::test_with_the_training_numerics_in_the_sampler_the_precision_part_vanishes",
    "tests/rl/packing_test.py::test_plan_is_first_fit_decreasing_whole_and_within_its_shard[1]",
    "tests/kernels/decode_attention_test.py::test_on_a_mesh_each_device_runs_the_kernel_on_its_own_rows",
)


# The longest `slow` tests (`beyond_ci`): their times on 2 cores beside other work
# (docs/guides/testing.md) add up to over an hour. Run them with `pytest -m beyond_ci`, the
# others with `pytest -m 'slow and not beyond_ci'`.
BEYOND_CI = (
    "tests/rl/packing_test.py::test_every_loss_aggregation_and_replay_packed_equals_padded",
    "tests/reliability_test.py::test_ctrl_c_during_a_save_ends_the_run_in_bounded_time_20_times",
    "tests/multihost_test.py::test_partial_rollouts_on_two_processes_equal_one",
    "tests/multihost_test.py::test_two_processes_equal_one_and_resume",
    "tests/multihost_test.py::test_a_dead_peer_stops_the_run_with_a_clear_error",
    "tests/reliability_test.py::test_a_killed_partial_rollout_run_resumes_to_the_uninterrupted_run",
    "tests/rl/packing_test.py::test_sharded_packed_update_equals_unsharded",
    "tests/rl/step_fns_test.py::test_sharded_update_equals_unsharded",
    "tests/experiments/experiments_test.py::test_tiny_preset_smoke",
)


def mark_tiers(items) -> None:
    """Mark `slow` and `sampled` the cases of each SAMPLED product outside its
    default-tier sample (`integration` for those of SAMPLED_IN_CI), `integration` each
    HEAVY test, `slow` and `sampled` the cases of SAMPLED_IN_INTEGRATION that CI does not
    keep, `slow` the tests of LINES_RUN_ELSEWHERE, and `beyond_ci` the `slow` tests of
    BEYOND_CI (collection time, before `-m` selects)."""
    for item in items:
        if item.get_closest_marker("slow") and family(item.nodeid) in BEYOND_CI:
            item.add_marker(pytest.mark.beyond_ci)
    by_family: dict[str, list] = {}
    for item in items:  # the cases `slow` or `tpu` hold stay there
        if not {"slow", "tpu"} & {m.name for m in item.iter_markers()}:
            by_family.setdefault(family(item.nodeid), []).append(item)
    marked = set()
    for name in SAMPLED:
        marked |= sampled_out([i.nodeid for i in by_family.get(name, [])])
    for item in (i for group in by_family.values() for i in group):
        if item.nodeid in marked and family(item.nodeid) not in SAMPLED_IN_CI:
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.sampled)
        elif item.nodeid in marked or {item.nodeid, family(item.nodeid)} & set(HEAVY):
            item.add_marker(pytest.mark.integration)
    for name, kept in SAMPLED_IN_INTEGRATION.items():
        keep = {f"{name}[{case}]" for case in kept}
        for item in by_family.get(name, []):
            if item.nodeid not in keep:
                item.add_marker(pytest.mark.slow)
                item.add_marker(pytest.mark.sampled)
    for item in items:
        if item.nodeid in LINES_RUN_ELSEWHERE:
            item.add_marker(pytest.mark.slow)


def stale_entries(items) -> list[str]:
    """The entries of SAMPLED, HEAVY, BEYOND_CI, LINES_RUN_ELSEWHERE and
    SAMPLED_IN_INTEGRATION that name no test: their file is gone, or it was collected (in
    `items`) and holds no test of that name. A moved or renamed test would otherwise drop
    out of its tier unnoticed."""
    if not items:
        return []
    root = items[0].session.config.rootpath
    names = {n for i in items for n in (i.nodeid, family(i.nodeid))}
    collected = {i.nodeid.split("::")[0] for i in items}
    entries = SAMPLED + HEAVY + BEYOND_CI + LINES_RUN_ELSEWHERE + tuple(SAMPLED_IN_INTEGRATION)
    return sorted(e for e in set(entries)
                  if not (root / e.split("::")[0]).exists()
                  or (e.split("::")[0] in collected and e not in names))


def _refuse(what: str):
    def refused(*args, **kwargs):
        pytest.fail(f"a default-tier test started {what}: mark it `integration` "
                    "(tests/tiers.py, docs/guides/testing.md)", pytrace=False)
    return refused


def guarded(item) -> pytest.MonkeyPatch | None:
    """For a test without a STARTERS marker, a MonkeyPatch under which starting a run, an
    SFT run, a child process or a notebook kernel fails the test (undo it afterwards); it
    covers the test's fixtures of every scope that it sets up. None for the others."""
    if STARTERS & {m.name for m in item.iter_markers()}:
        return None
    mp = pytest.MonkeyPatch()
    try:
        from stablerl_jax.rl import loop, sft
    except ModuleNotFoundError:  # a partial install (a GPU image without the data stack):
        pass                     # no run can start there
    else:
        mp.setattr(loop, "_run", _refuse("a run (rl.loop.run)"))
        mp.setattr(sft, "train_sft", _refuse("an SFT run (rl.sft.train_sft)"))
    mp.setattr(subprocess.Popen, "__init__", _refuse("a child process"))
    mp.setattr(multiprocessing.process.BaseProcess, "start", _refuse("a child process"))
    return mp
