"""Prometheus metrics of the learner, on the default registry.

Names are the canonical ones of HELPERS.md (the deploy/ dashboards use them);
the ``farm_learner_advantage_*``, ``farm_learner_ratio_*``, ``farm_learner_grad_norm``,
``farm_learner_dropped_groups_total`` and ``farm_learner_skipped_batches_total`` are
additions, as are the loss-term gauges and the dynamic-sampling and no-action-timeout
counters of issue 15.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

STEPS = Counter("farm_learner_steps", "Optimizer steps taken")
STEP_SECONDS = Histogram(
    "farm_learner_step_seconds",
    "Wall time of one step (wait + compute)",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
WAIT_SECONDS = Histogram(
    "farm_learner_wait_seconds",
    "Time a step waited for a full batch",
    buckets=(0.001, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60),
)
SAMPLES = Counter("farm_learner_samples", "Sequences trained")
LOSS = Gauge("farm_learner_loss", "Policy loss of the last step")
REWARD_MEAN = Gauge("farm_learner_reward_mean", "Mean episode return of the last batch")
CLIP_FRACTION = Gauge("farm_learner_clip_fraction", "Fraction of tokens with the PPO clip active")
ENTROPY = Gauge("farm_learner_entropy", "Mean token entropy of the last step")
ROLLOUT_ENTROPY = Gauge(
    "farm_learner_rollout_entropy",
    "Mean -log(behaviour prob) of every sampled token of the last batch, trained or skipped "
    "(nats/token: the sampling policy's entropy)",
)
DETERMINISTIC_FRACTION = Gauge(
    "farm_learner_deterministic_fraction",
    "Fraction of the last batch's groups whose samples were all identical",
)
POLICY_VERSION = Gauge("farm_learner_policy_version", "Policy version after the last step")
STALENESS = Histogram(
    "farm_learner_staleness_steps",
    "Policy versions between rollout and training",
    buckets=(0, 1, 2, 3, 4, 6, 8, 16, 32, 64),
)
STALE_GROUPS = Counter("farm_learner_stale_groups", "Groups beyond max_staleness", ["action"])
ZERO_VARIANCE = Counter("farm_learner_zero_variance_groups", "Groups whose returns were all equal")
ZERO_VARIANCE_REWARD = Counter(
    "farm_learner_zero_variance_reward",
    "Sum of the zero-variance groups' common returns (over farm_learner_zero_variance_groups: "
    "their mean; 1 for a solved toy, 0 for tasks too hard)",
)
GROUPS = Counter("farm_learner_groups", "Groups in the learner's batches, trained or not")
INFRA_FAILED = Counter("farm_learner_infra_failed_groups", "Groups spoiled by infrastructure")
PUSH_SECONDS = Histogram(
    "farm_learner_weight_push_seconds",
    "Push and verify new weights",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
LAST_STEP = Gauge("farm_learner_last_step_timestamp_seconds", "Unix time of the last step")
TASKS_ISSUED = Counter("farm_learner_tasks_issued", "Tasks published inside the admission budget")
ADVANTAGE_MEAN = Gauge("farm_learner_advantage_mean", "Mean per-turn advantage of the last step")
ADVANTAGE_STD = Gauge("farm_learner_advantage_std", "Std of per-turn advantages of the last step")
RATIO_MEAN = Gauge("farm_learner_ratio_mean", "Mean importance ratio to the behaviour policy")
RATIO_MAX = Gauge("farm_learner_ratio_max", "Largest importance ratio of the last step")
GRAD_NORM = Gauge("farm_learner_grad_norm", "Gradient norm before clipping")
NO_ACTION_TIMEOUTS = Counter(
    "farm_learner_no_action_timeout_groups",
    "Groups not trained: an episode timed out before its first action",
)
OVERLONG = Counter("farm_learner_overlong_episodes", "Episodes cut by the context limit")
FILTERED_GROUPS = Counter(
    "farm_learner_filtered_groups",
    "Groups dynamic sampling kept out of a batch's count",
    ["reason"],
)
FILTER_RATE = Gauge("farm_learner_filter_rate", "Measured fraction of groups filtered out")
DUAL_CLIP_FRACTION = Gauge("farm_learner_dual_clip_fraction", "Tokens with the dual clip active")
CORRECTION_FRACTION = Gauge(
    "farm_learner_correction_fraction", "Tokens whose pi_prox/mu was capped (TIS) or masked (MIS)"
)
KL = Gauge("farm_learner_kl", "Mean per-token KL estimate to the reference")
VALUE_LOSS = Gauge("farm_learner_value_loss", "Clipped value loss of the critic (ppo)")
BEHAVIOUR_RATIO_MAX = Gauge(
    "farm_learner_behaviour_ratio_max", "Largest pi_prox/mu of the last step, before the cap"
)
BEHAVIOUR_RATIO_MIN = Gauge(
    "farm_learner_behaviour_ratio_min", "Smallest pi_prox/mu of the last step"
)
BEHAVIOUR_LOG_RATIO_STD = Gauge(
    "farm_learner_behaviour_log_ratio_std",
    "Spread (std) of log pi_prox/mu over the last step's tokens",
)
OUTSIDE_MASS = Gauge(
    "farm_learner_outside_mass",
    "Mean policy mass outside the tokens' sampled support (allowed set, "
    "truncation) in the last step",
)
SKIPPED_BATCHES = Counter(
    "farm_learner_skipped_batches",
    "Batches that took no step: no trainable sample, or an exactly-zero gradient (no push)",
)
ZERO_GRADIENT_BATCHES = Counter(
    "farm_learner_zero_gradient_batches",
    "Skipped batches whose samples carried an exactly-zero gradient (no optimizer step)",
)
EVAL_SCORE = Gauge(
    "farm_learner_eval_score",
    "Last evaluation's figures per eval set (and set/env)",
    ["set", "metric"],
)
EVAL_STEP = Gauge("farm_learner_eval_step", "Learner step at which the last evaluation started")
