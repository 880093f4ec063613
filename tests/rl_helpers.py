"""A tiny experiment config shared by the RL tests, the special ids its tests use (the
SentencePiece tokenizer's: pad 0, eos 3), and a sampled rollout as offline-file records."""
import numpy as np

from stablerl_jax.config import (
    ExperimentConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
    RLConfig,
    SamplingConfig,
    SFTConfig,
    TaskConfig,
)

EOS_ID, PAD_ID = 3, 0


def tiny_cfg(mesh=(1, 1, 1), learning_rate=1e-3, **rl) -> ExperimentConfig:
    return ExperimentConfig(
        name="test",
        model=ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                          head_dim=8, num_experts=8, top_k=2, expert_ffn_dim=32,
                          max_seq_len=40, moe_tile=8),
        task=TaskConfig(num_train=64, num_test=16, max_prompt_len=16, max_solution_len=40),
        sampling=SamplingConfig(max_new_tokens=16),
        loss=LossConfig(),
        rl=RLConfig(**{"steps": 2, "prompts_per_step": 4, "group_size": 2,
                       "num_minibatches": 2, "eval_every": 2, "eval_k": 1, "eval_problems": 8,
                       "checkpoint_every": 1, "optim": OptimConfig(learning_rate=learning_rate),
                       **rl}),
        sft=SFTConfig(steps=2, batch_size=8),
        mesh=mesh)


def responses_from_rollout(rollout, rewards_B) -> list[dict]:
    """Our sampler's rollout (`rollout.Rollout`) as per-response records in the engine's convention (the
    inverse of `OfflineRollouts.batch`): routes of the processed tokens only, prompt
    then completion. What `write_rollouts` takes."""
    r = {k: np.asarray(v) for k, v in rollout._asdict().items() if v is not None}
    out = []
    for b in range(r["tokens_BxS"].shape[0]):
        prompt, comp = r["prompt_mask_BxS"][b], r["completion_mask_BxS"][b]
        # Processed slots: the prompt, then every completion token but the last.
        processed = prompt.copy()
        processed[np.flatnonzero(comp)[:-1]] = True
        rec = {"prompt_ids": r["tokens_BxS"][b, prompt],
               "completion_ids": r["tokens_BxS"][b, comp],
               "logp_mu": r["logp_mu_BxS"][b, comp],
               "routes": r["routes_mu_BxSxLxK"][b, processed],
               "reward": float(np.asarray(rewards_B)[b])}
        if "route_weights_mu_BxSxLxK" in r:
            rec["route_weights"] = r["route_weights_mu_BxSxLxK"][b, processed]
        out.append(rec)
    return out


def kill_cold_start_at(monkeypatch, step: int = 4):
    """Make the cold start raise KeyboardInterrupt when it reaches `step` (1-based) of its
    batches, as a Ctrl-C there would; returns the real `sft_data.batches`."""
    from stablerl_jax.data import sft_data
    real = sft_data.batches

    def dies(*args, **kwargs):
        for i, b in enumerate(real(*args, **kwargs), start=args[-1] if len(args) > 6 else 0):
            if i == step - 1:
                raise KeyboardInterrupt("killed")
            yield b

    monkeypatch.setattr(sft_data, "batches", dies)
    return real


def versions_and_rollout(cfg: ExperimentConfig, factors=(1.0, 1.1, 0.9), rows: int = 8):
    """(parameter versions: one random init scaled by each factor, a rollout sampled with
    the first under FP8 numerics, each token's age: 0 or 1 alternating over the
    completion, 1 elsewhere) for the scores of partial rollouts (rl.old_policy=behavior)."""
    import jax
    import jax.numpy as jnp

    from stablerl_jax.model import numerics as nx
    from stablerl_jax.model import transformer as tf
    from stablerl_jax.sampling import rollout as ro
    params = [jax.tree.map(lambda w, f=f: w * f, tf.init_params(jax.random.key(0), cfg.model))
              for f in factors]
    p = cfg.task.max_prompt_len
    prompts = jax.random.randint(jax.random.key(1), (rows, p), 3, cfg.model.vocab_size)
    r = ro.sample(params[0], prompts, jnp.ones((rows, p), bool), jax.random.key(2), cfg.model,
                  cfg.sampling, nx.numerics_preset("fp8"), eos_id=2, pad_id=0)
    comp = np.asarray(r.completion_mask_BxS)
    age = np.where(comp, (np.arange(comp.shape[1]) % 2)[None, :], 1).astype(np.int32)
    return params, r, age
