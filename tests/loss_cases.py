"""Loss configurations shared by the loss-library and fused-op tests: every method and
aggregation mode, alone and composed."""

from megatron_rl.algo import AlgorithmConfig, LoptiConfig, STAPOConfig, TRGRPOConfig

LOSS_CASES: dict[str, AlgorithmConfig] = {
    "grpo": AlgorithmConfig(),
    "grpo_kl_k3_entropy": AlgorithmConfig(kl_coef=0.3, entropy_coef=0.05),
    "kl_k1": AlgorithmConfig(kl_coef=0.2, kl_estimator="k1"),
    "kl_k2_no_dual": AlgorithmConfig(kl_coef=0.2, kl_estimator="k2", dual_clip_c=None),
    "seq_mean": AlgorithmConfig(aggregation="seq_mean_token_mean", kl_coef=0.1),
    "dr_grpo_norm": AlgorithmConfig(aggregation="seq_mean_token_sum_norm", constant_normalizer=9),
    "microbatch_mean": AlgorithmConfig(aggregation="reference_microbatch_mean"),
    "lopti_low": AlgorithmConfig(lopti=LoptiConfig(enabled=True, eta=0.3), kl_coef=0.1, entropy_coef=0.01),
    "lopti_high_phase_den": AlgorithmConfig(lopti=LoptiConfig(enabled=True, eta=0.3, denominator="phase")),
    "tr_ratio": AlgorithmConfig(tr_grpo=TRGRPOConfig(enabled=True, tau=0.7, lower=0.2, upper=1.2), kl_coef=0.2),
    "tr_loss": AlgorithmConfig(tr_grpo=TRGRPOConfig(enabled=True, placement="loss", alpha=1.5), kl_coef=0.2),
    "stapo": AlgorithmConfig(stapo=STAPOConfig(enabled=True, tau_p=0.2, entropy_quantile=0.6), eps_high=0.28),
    "all_composed": AlgorithmConfig(
        lopti=LoptiConfig(enabled=True, eta=0.5),
        tr_grpo=TRGRPOConfig(enabled=True),
        stapo=STAPOConfig(enabled=True, tau_p=0.3),
        kl_coef=0.05,
        entropy_coef=0.02,
        aggregation="seq_mean_token_mean",
    ),
}


def lopti_phase_for(name: str, cfg: AlgorithmConfig):
    """The Lopti pass a case exercises (``None`` when Lopti is off)."""
    if not cfg.lopti.enabled:
        return None
    return "high" if "high" in name else "low"
