"""Test cases deselected by default (``-m slow`` runs them): the longest of the suite, measured.

``python -m pytest -q --durations=200`` on a 2-core machine shared with two other jobs (about
2.5x the times of a machine to itself), 2026-11-28: each case below took at least 17 s there,
and together 1.9 of the suite's 4.6 thousand seconds. Each has quicker siblings that stay in
the default run (another parametrisation, the same quantity on a smaller model, the mlp of
the same family), so the default run still covers every quantity, family and front end
(the influence example's ``--quick`` run, 87 s alone, stays in: it is what CI shows of it);
``conftest.py`` marks these ``slow`` at collection.
"""

SLOW = frozenset({
    "tests/project/test_examples_smoke.py::test_example_runs_quick_and_writes_png[hessian_spectrum.py]",  # 77 s
    "tests/operators/test_models.py::test_products_on_the_sweeps_models[transformers/causal_lm/gpt2-direct]",  # 35 s
    "tests/operators/test_models.py::test_products_on_the_sweeps_models[transformers/causal_lm/qwen2_moe-direct]",  # 56 s
    "tests/operators/test_models.py::test_products_on_the_sweeps_models[transformers/seq_cls/qwen2-direct]",  # 15 s
    "tests/project/test_influence_lds_benchmark.py::test_quick_run_scores_every_method",  # 50 s
    "tests/rules/test_rnn_hessian.py::test_pchmp",  # 82 s
    "tests/rules/test_attention_models.py::test_whole_transformer",  # 74 s
    "tests/_trace/test_opaque.py::test_every_exact_extension_matches_brute_force",  # 72 s
    "tests/_evaluate/test_second_order_exact.py::test_recurrent_ggn",  # 66 s
    "tests/_trace/test_aten.py::test_an_input_that_takes_another_branch_is_traced_again",  # 59 s
    "tests/rules/test_attention.py::test_transformer_encoder_tied_padding",  # 59 s
    "tests/project/test_examples_smoke.py::test_example_runs_quick_and_writes_png[dp_sgd.py]",  # 57 s
    "tests/project/test_examples_smoke.py::test_example_runs_quick_and_writes_png[laplace_digits.py]",  # 57 s
    "tests/_plan/test_constants_of_batch_shape.py::test_alibi_bias_on_merged_heads",  # 48 s
    "tests/rules/test_rnn_kron.py::test_kflr_and_empirical_factors",  # 48 s
    "tests/project/test_examples_smoke.py::test_example_runs_quick_and_writes_png[ddp_curvature.py]",  # 45 s
    "tests/_interpret/test_graphs.py::test_random_dag_hessian_family",  # 45 s
    "tests/project/test_examples_smoke.py::test_example_runs_quick_and_writes_png[pruning.py]",  # 45 s
    "tests/project/test_examples_smoke.py::test_example_runs_quick_and_writes_png[natural_gradient.py]",  # 44 s
    "tests/_interpret/test_graphs.py::test_zoo_hessian_family[transformer_per_token]",  # 44 s
    "tests/_evaluate/test_second_order_exact.py::test_batchnorm_eval",  # 43 s
    "tests/rules/test_attention.py::test_multihead_attention_options",  # 43 s
    "tests/_transform/test_compile_program.py::test_compiled_equals_eager_and_oracle[cnn-torch.float64]",  # 43 s
    "tests/_transform/test_compile_program.py::test_compiled_equals_eager_and_oracle[cnn-torch.float32]",  # 43 s
    "tests/_evaluate/test_second_order_exact.py::test_cnn",  # 40 s
    "tests/rules/test_attention.py::test_transformer_decoder_layer",  # 39 s
    "tests/_evaluate/test_monte_carlo.py::test_mc_sample_mean_matches_exact_diag[bce]",  # 38 s
    "tests/rules/test_rnn_hessian.py::test_module_applied_to_its_own_output",  # 35 s
    "tests/_interpret/test_graphs.py::test_zoo_hessian_family[transformer]",  # 35 s
    "tests/_interpret/test_graphs.py::test_random_dag_hessian_family_shared",  # 34 s
    "tests/distributed/test_distributed.py::test_every_extension_equals_single_process_on_full_batch[3procs]",  # 34 s
    "tests/_plan/test_merged_batch.py::test_windows_second_order",  # 32 s
    "tests/_transform/test_compile_program.py::test_compiled_losses[ce-weight]",  # 32 s
    "tests/rules/test_rnn_hessian.py::test_frozen_parameters",  # 32 s
    "tests/_evaluate/test_second_order_exact.py::test_conv_transpose",  # 31 s
    "tests/rules/test_functional_inplace.py::test_inplace_parameter_updates_are_exact",  # 31 s
    "tests/_trace/test_opaque.py::test_kflr_exact_for_traced_layers",  # 30 s
    "tests/_evaluate/test_monte_carlo.py::test_mc_sample_mean_matches_exact_diag[mse]",  # 30 s
    "tests/_trace/test_functions.py::test_function_runs_its_backward_on_the_aten_path",  # 29 s
    "tests/_evaluate/test_pchmp.py::test_groupnorm",  # 29 s
    "tests/_trace/test_aten_ops.py::test_parameter_uses_that_are_no_modules_forward",  # 29 s
    "tests/_interpret/test_graphs.py::test_random_dag_hessian_family_products",  # 28 s
    "tests/_transform/test_compile_program.py::test_compiled_losses[mse]",  # 27 s
    "tests/_interpret/test_graphs.py::test_random_dag_ggn_family",  # 27 s
    "tests/_transform/test_compile_program.py::test_compiled_losses[ce-ignore]",  # 27 s
    "tests/_transform/test_compile_program.py::test_user_fullgraph_step[DiagGGNExact]",  # 26 s
    "tests/_transform/test_compile_program.py::test_compiled_equals_eager_and_oracle[mlp-torch.float32]",  # 25 s
    "tests/_interpret/test_graphs.py::test_zoo_hessian_family[standardised_conv]",  # 25 s
    "tests/rules/test_batchnorm.py::test_batchnorm_batch_in_spatial_dim_second_order",  # 24 s
    "tests/_plan/test_constants_of_batch_shape.py::test_function_on_merged_rows_is_tested_numerically",  # 23 s
    "tests/_evaluate/test_pchmp.py::test_module_used_twice",  # 22 s
    "tests/_plan/test_constants_of_batch_shape.py::test_created_mask_is_a_constant",  # 18 s
    "tests/_transform/test_ecosystem.py::test_fast_slice[torchvision/mobilenet_v3_small-direct-ggn]",  # 18 s
    "tests/_evaluate/test_pchmp.py::test_layernorm",  # 17 s
    "tests/rules/test_rnn_hessian.py::test_diag_and_batch_diag_hessian",  # 17 s
    "tests/_transform/test_compile_program.py::test_user_fullgraph_step[KFAC]",  # 17 s
})
