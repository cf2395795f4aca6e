"""The score-function (REINFORCE) boundary policy, the method megatok exists for.

A linear head on each encoder state gives a soft-capped logit l_t = c * tanh(f(h_t) / c); in
training b_t ~ Bernoulli(sigmoid(l_t)), with b_1 = 1 forced. After the forward pass, the reward at
t is how much the full model beats the early-exit head on the prediction made at t
(CE_early - CE_full, detached); a batch-relative baseline and discounted returns
G_t = sum_k gamma^(k-t) A_k turn it into the credit for the decision at t. See
docs/method.md.

``window`` w conditions each decision on the previous w - 1 decisions (w = 1: independent
Bernoulli per byte, the default): l_t = c tanh((f_0(h_t) + sum_{k=1}^{w-1} f_k(h_t) b_{t-k}) / c), with
f_k linear heads on h_t (f_1.. start at zero, so every w starts as w = 1). Each decision then
depends on the ones before it: they are drawn under no_grad by a parallel scan over the 2^(w-1) window
states (megatok/boundaries/_scan.py; a loop over positions for wide windows on a CPU), and the
log-probabilities of the decisions taken are recomputed in one vectorised pass afterwards. The policy stays causal: b_t
reads h_t and b_{<t}.

``lag`` k reads h_{t-k} instead of h_t for the decision at t (zeros before the sequence and within k
bytes of a forced start): with k = 1 the decision taken on seeing a space places the start at the word's
first byte. The decision index, its log-probability and its credit stay at t.

Forced starts (t = 0; with document masking every SEP) are no decisions: no policy term, and a
window never reads decisions from before the latest forced start (they count as 0, like positions
before the sequence). Returns stop at a forced start too: a document's decisions are not credited
with the next document's rewards, which they cannot affect once documents are masked.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from torch import nn

from megatok import rl
from megatok.boundaries.base import (Boundaries, BoundaryStrategy, finalize_starts, initialise, since_forced,
                                    uniform_noise)
from megatok.stats import space_before_word


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid")
    gamma: float = Field(0.99, ge=0, le=1, description="discount of future advantages")
    logit_cap: float = Field(6.0, gt=0, description="soft cap c: logit = c tanh(f(h) / c)")
    lambda_policy: float = Field(0.01, ge=0, description="weight of the policy-gradient loss")
    lambda_rate: float = Field(0.01, ge=0, description="weight of the rate loss holding p at target_rate")
    batch_baseline: bool = Field(True, description="subtract the batch mean reward at each position")
    baseline_scope: Literal["micro_batch", "data_parallel"] = Field(
        "micro_batch", description="the batch baseline's mean: over this rank's micro-batch, or over the "
                                   "micro-batches of all data-parallel ranks (the published batch at accumulation 1)")
    early_exit_reward: bool = Field(True, description="reward CE_early - CE_full; off: reward -CE_full")
    window: int = Field(1, ge=1, le=64, description="condition each decision on the previous window-1 decisions (1: independent per byte)")
    lag: int = Field(0, ge=0, le=8, description="decide whether a chunk starts at t from the encoder state at "
                     "t - lag (1: the decision made at a byte places a start at the next one, so a policy that "
                     "reacts to a space starts its chunk at the word's first byte; 0: at t itself, published)")
    rate_scope: Literal["batch", "sequence"] = Field("batch", description="hold the rate at target over the micro-batch (published), or in every sequence")
    # Variance reduction and schedules beyond the published estimator; every one is off by default.
    estimator: Literal["reinforce", "disarm"] = Field(
        "reinforce", description="reinforce: the score function G_t grad log pi(b_t) (published); disarm: the "
                                 "antithetic DisARM estimator over two samples drawn from u and 1 - u (needs samples 2 "
                                 "and window 1; the pair's difference replaces every baseline)")
    samples: int = Field(1, ge=1, le=16, description="boundary samples per training sequence: the model runs each "
                         "sequence this many times (the encoder once), and each sample's baseline is the mean reward "
                         "of the sequence's other samples at the same position (replaces the batch baseline; costs "
                         "the main network and decoder this many times per byte)")
    leave_one_out: bool = Field(False, description="batch baseline without the sequence's own reward (unbiased; "
                                "B/(B-1) times the published advantage)")
    value_baseline: bool = Field(False, description="subtract a learned per-position value V(h_t) (a linear head on the "
                                 "detached encoder state, trained to predict the return) from the return")
    lambda_value: float = Field(0.01, ge=0, description="weight of the value head's squared-error loss")
    normalize_advantage: bool = Field(False, description="divide the returns by their standard deviation over the "
                                      "micro-batch's decisions")
    start_margin: float | None = Field(0.01, ge=0, description="the policy learns once the early-exit head trails "
                                       "the full model by this many bits per byte (a moving average over micro-batches "
                                       "and all ranks, from start_step on): until then neither its term nor the rate "
                                       "term is on; latched on from then (docs/method.md, 'The policy's pace'); null: "
                                       "from start_step, as published")
    start_ema: float = Field(0.95, ge=0, lt=1, description="decay per micro-batch of start_margin's moving average "
                             "(0: each micro-batch alone)")
    gamma_start: float | None = Field(None, ge=0, le=1, description="discount at step 0, moving linearly to gamma "
                                      "over gamma_steps optimizer steps")
    gamma_steps: int = Field(0, ge=0, description="steps of the gamma schedule (with gamma_start)")
    # The policy's own pace (megatok.train.engine gives its parameters their own learning rate when one is set).
    lr_scale: float = Field(0.25, gt=0, le=100, description="learning rate of the policy's own parameters (its heads) "
                            "relative to train.lr: 0.25 keeps the policy near its start until the main network has "
                            "learned what a chunk start can be worth (docs/method.md, 'The policy's pace'); 1 is the "
                            "published estimator")
    start_step: int = Field(50, ge=0, description="optimizer steps before the policy can learn (and start_margin's "
                            "average starts): until then its heads do not move and neither the policy nor the rate "
                            "term is on (the model trains on the chunks of the policy as initialised: uniform random "
                            "at the target rate); 0 is the published estimator")
    lr_warmup_steps: int = Field(0, ge=0, description="after start_step, the heads' learning rate rises linearly from "
                                 "0 over this many steps")
    lr_hold: bool = Field(True, description="the heads' learning rate holds at lr_scale x train.lr after the model's "
                          "warmup instead of following its decay: a policy whose latch opens late in the run (when "
                          "the model's learning rate has decayed) still learns at its pace (docs/method.md, 'The "
                          "policy's pace'); false: the model's schedule, as published")
    explore: float = Field(0.0, ge=0, lt=1, description="epsilon: training draws from (1 - epsilon) p + epsilon "
                           "target_rate (the log-probability is that of the draw; evaluation uses p)")
    entropy: float = Field(0.0, ge=0, description="weight of an entropy bonus relative to the target rate: the "
                           "penalty -entropy x mean KL(Bernoulli(p_t) || Bernoulli(target_rate)) over decisions, "
                           "whose pull is towards p = target_rate (a plain entropy bonus pulls to 0.5, against the "
                           "rate term)")
    explore_steps: int = Field(0, ge=0, description="explore and entropy fall linearly to 0 over this many steps from "
                               "start_step (0: they stay)")

    @model_validator(mode="after")
    def _combinations(self):
        if self.gamma_start is not None and not self.gamma_steps:
            raise ValueError("gamma_start needs gamma_steps > 0 (the steps over which gamma moves to its value)")
        if self.explore and (self.estimator == "disarm" or self.window > 1):
            raise ValueError("explore draws independent decisions from a mixed probability: not with estimator "
                             "'disarm' or window > 1")
        if self.estimator == "disarm":
            if self.samples != 2 or self.window != 1:
                raise ValueError("estimator 'disarm' draws two antithetic samples of independent decisions: set "
                                 "samples 2 and window 1")
            if self.value_baseline or self.normalize_advantage:
                raise ValueError("estimator 'disarm' takes no value_baseline or normalize_advantage (the pair's "
                                 "difference is its baseline)")
            return self
        if self.samples > 1 and (not self.batch_baseline or self.leave_one_out or self.baseline_scope != "micro_batch"):
            raise ValueError("samples > 1 takes each sample's baseline from the other samples of its sequence: "
                             "batch_baseline, leave_one_out and baseline_scope do not apply (leave them at their defaults)")
        return self


class Strategy(BoundaryStrategy):
    def __init__(self, *, d_model, target_rate, options: Options):
        super().__init__(d_model=d_model, target_rate=target_rate, options=options)
        self.head = nn.Linear(d_model, 1)
        # Bias such that the capped logit starts at logit(rho), i.e. p starts at the target rate.
        c = options.logit_cap
        target_logit = math.log(target_rate / (1 - target_rate))
        bias = c * math.atanh(max(-0.999, min(0.999, target_logit / c)))

        def init_head(m):
            nn.init.normal_(m.weight, std=0.02 / math.sqrt(d_model))
            nn.init.constant_(m.bias, bias)

        initialise(self.head, init_head)
        # Only with window > 1, so checkpoints of the independent policy keep their parameter names.
        self.window_head = nn.Linear(d_model, options.window - 1) if options.window > 1 else None
        if self.window_head is not None:
            initialise(self.window_head, lambda m: (nn.init.zeros_(m.weight), nn.init.zeros_(m.bias)))
        # Only with the option, so other runs' checkpoints keep their state dicts.
        self.value_head = nn.Linear(d_model, 1) if options.value_baseline else None
        if self.value_head is not None:
            initialise(self.value_head, lambda m: (nn.init.zeros_(m.weight), nn.init.zeros_(m.bias)))
        if options.start_margin is not None:
            self.register_buffer("started", torch.zeros((), dtype=torch.bool))
            self.register_buffer("gap_ema", torch.zeros((), dtype=torch.float32))
        # the trainer's step as a tensor too (not saved: restored with the trainer's step), which the training
        # terms read: compiled code then does not specialise on it, and does not recompile as it moves
        self.register_buffer("step_now", torch.zeros((), dtype=torch.long), persistent=False)
        self._step = 0
        # window 1: b_t reads h_{t-lag} and its noise
        self.reach = options.lag if options.window == 1 else None

    @classmethod
    def check_config(cls, options: Options, cfg, world_size: int) -> None:
        across = options.baseline_scope == "data_parallel"
        if options.batch_baseline and cfg.train.micro_batch_size * (world_size if across else 1) < 2:
            raise ValueError("boundary.batch_baseline needs train.micro_batch_size >= 2, or boundary.baseline_scope "
                             "'data_parallel' on 2 or more ranks (the baseline is the mean over the batch; with 1 "
                             "sequence every advantage is 0)")

    @classmethod
    def param_count(cls, options: Options, *, d_model: int, target_rate: float) -> int:
        """A d -> 1 head, with window w > 1 a d -> w - 1 window head, with value_baseline a d -> 1 value
        head, each with its bias: (d + 1)(w + value_baseline)."""
        return (d_model + 1) * (options.window + options.value_baseline)

    @classmethod
    def flops_per_byte(cls, options: Options, *, d_model: int, target_rate: float) -> float:
        """2 per parameter, and with window > 1 the head and window head twice: once to draw the decisions
        (the scan), once for the log-probabilities of the decisions taken."""
        heads = 2.0 * (d_model + 1) * options.window
        return heads * (2 if options.window > 1 else 1) + 2.0 * (d_model + 1) * options.value_baseline

    @classmethod
    def samples_per_sequence(cls, options: Options) -> int:
        return options.samples

    @property
    def reads_earlier_decisions(self) -> bool:
        return self.window_head is not None

    def variant(self, update: dict) -> Options:
        """These options with ``update`` applied: an estimator variant to measure on the trained model
        (megatok-estimator-variance). ValueError, one line, for an unknown or invalid option, or one the
        trained model cannot take (value_baseline needs a trained value head; start_margin switches the
        term off)."""
        try:
            options = self.options.model_validate({**self.options.model_dump(), **update})
        except ValidationError as e:
            err = e.errors()[0]
            raise ValueError(f"{'.'.join(map(str, err['loc']))}: {err['msg']}") from None
        for key, why in (("value_baseline", "needs a trained value head"), ("start_margin", "switches the term off")):
            if key in update:
                raise ValueError(f"{key} {why}: measure it in training")
        return options

    def estimator_settings(self) -> dict:
        """The trained estimator's settings an estimator-variance report records."""
        o = self.options
        return {"lambda_policy": o.lambda_policy, "batch_baseline": o.batch_baseline,
                "early_exit_reward": o.early_exit_reward, "trained_gamma": o.gamma}

    def gamma_now(self) -> float | torch.Tensor:
        """The discount at the optimizer step the trainer set (``step``): while compiling, a tensor of
        ``step_now`` (a float would be a constant of the graph, recompiled at every step of the schedule)."""
        o = self.options
        if o.gamma_start is None or not self.training:
            return o.gamma
        if torch.compiler.is_compiling():
            frac = (self.step_now.double() / o.gamma_steps).clamp(max=1.0)  # float64: past the end, gamma itself
        else:
            frac = min(1.0, self.step / o.gamma_steps)
        return o.gamma_start + (o.gamma - o.gamma_start) * frac

    def lr_factor(self, step: int) -> float | None:
        """0 before start_step, then lr_scale, reached linearly over lr_warmup_steps; None at the published
        setting (lr_scale 1, start_step 0, lr_warmup_steps 0, lr_hold false: the heads then follow the model's
        schedule in its own parameter groups)."""
        o = self.options
        if o.lr_scale == 1 and not o.start_step and not o.lr_warmup_steps and not o.lr_hold:
            return None
        if step < o.start_step:
            return 0.0
        ramp = min(1.0, (step - o.start_step + 1) / o.lr_warmup_steps) if o.lr_warmup_steps else 1.0
        return o.lr_scale * ramp

    @property
    def step(self) -> int:
        """The optimizer step the trainer set (BoundaryStrategy.step), kept as a tensor too (``step_now``)."""
        return self._step

    @step.setter
    def step(self, n: int) -> None:
        self._step = int(n)
        self.step_now.fill_(int(n))

    def learning(self) -> torch.Tensor | bool:
        """Whether the policy and rate terms are on: in training, from start_step on (a 0/1 float tensor of the
        step tensor: no host read, no specialisation on the step); always in evaluation (True)."""
        if not self.training:
            return True
        return (self.step_now >= self.options.start_step).float()

    def exploring(self) -> float | torch.Tensor:
        """The fraction of explore and entropy in force at the trainer's step (0 in evaluation and before
        start_step's policy learns nothing, so it does not matter there); while compiling with a schedule
        (explore_steps), a tensor of ``step_now``, as gamma_now's."""
        o = self.options
        if not self.training:
            return 0.0
        if not o.explore_steps:
            return 1.0
        if torch.compiler.is_compiling():
            return (1.0 - (self.step_now - o.start_step).clamp(min=0).float() / o.explore_steps).clamp(min=0.0)
        return max(0.0, 1.0 - max(0, self.step - o.start_step) / o.explore_steps)

    def _share(self, weight: float) -> float | torch.Tensor | None:
        """``weight`` (explore or entropy) x exploring(), or None where the term is off: in eager code when
        the product is 0; while compiling only when ``weight`` is (the term is then kept at a share of 0, the
        same value: a test of the share would be a branch on the step)."""
        if not (weight and self.training):
            return None
        share = weight * self.exploring()
        return share if torch.is_tensor(share) or share else None

    def logits(self, h: torch.Tensor, previous: torch.Tensor | None = None) -> torch.Tensor:
        """Capped logits. ``previous`` [B, T, w-1]: b_{t-1}, ..., b_{t-w+1} (window > 1 only)."""
        c = self.options.logit_cap
        raw = self.head(h).squeeze(-1).float()
        if self.window_head is not None:
            raw = raw + (self.window_head(h).float() * previous).sum(-1)
        return c * torch.tanh(raw / c)

    @staticmethod
    def previous_decisions(starts: torch.Tensor, w: int, forced: torch.Tensor) -> torch.Tensor:
        """[B, T] -> [B, T, w-1] with [..., k-1] = b_{t-k} (0 before the sequence and before the
        latest forced start at or before t)."""
        b, T = starts.float(), starts.shape[1]
        age = since_forced(forced)  # b_{t-k} is in t's piece iff k <= age
        return torch.stack([F.pad(b, (k, 0))[:, :T] * (age >= k) for k in range(1, w)], -1)

    def _draw(self, h: torch.Tensor, mask: torch.Tensor, mode: str, forced: torch.Tensor) -> torch.Tensor:
        """Decisions for window > 1, each reading the ones before it: a parallel scan over positions
        (megatok.boundaries._scan.draw; its per-position loop, draw_loop, is the reference)."""
        from megatok.boundaries import _scan as scan

        with torch.no_grad():
            base = self.head(h).squeeze(-1).float()
            weights = self.window_head(h).float()
            noise = uniform_noise(base, self.window)  # drawn at once: the same random stream as w = 1
            return scan.draw(base, weights, noise, mask, forced, self.options.logit_cap, mode)

    @staticmethod
    def lagged(h: torch.Tensor, lag: int, forced: torch.Tensor) -> torch.Tensor:
        """h_{t-lag} at t: zeros where that is before the sequence or before the latest forced start at or
        before t (a decision never reads another document's bytes), so there the head gives its bias."""
        shifted = F.pad(h, (0, 0, lag, 0))[:, :h.shape[1]]
        return shifted * (since_forced(forced) >= lag)[..., None].to(h.dtype)

    def forward(self, h, x, mask, forced) -> Boundaries:
        mode = "sample" if self.training else self.eval_mode
        if self.options.lag:
            h = self.lagged(h, self.options.lag, forced)
        if self.window_head is None:
            logits = self.logits(h)
            probs = torch.sigmoid(logits)
            eps = self._share(self.options.explore)
            if eps is not None:  # the draw's own probability: the log-probability below is that of the decision taken
                probs = (1 - eps) * probs + eps * self.target_rate
            if mode == "sample":
                noise = uniform_noise(probs, self.window)
                if self.training and self.options.estimator == "disarm":  # rows 2i, 2i + 1: u and 1 - u
                    noise = torch.stack([noise[0::2], 1 - noise[0::2]], 1).flatten(0, 1)
                starts = noise < probs
            else:  # "threshold". (A "top rho fraction per sequence" rule would look at later bytes: not causal.)
                starts = probs > 0.5
            starts = finalize_starts(starts.detach(), mask, forced)
        else:
            starts = finalize_starts(self._draw(h, mask, mode, forced), mask, forced)
            logits = self.logits(h, self.previous_decisions(starts, self.options.window, forced))
            probs = torch.sigmoid(logits)
        log_probs = self._log_probs(starts, logits, probs)
        sbw = torch.zeros_like(mask) if x is None else space_before_word(x) & mask  # x None: bare tests
        extra = {"logits": logits, "sbw": sbw}
        if self.window_head is not None:  # what ``taken`` needs to condition on other earlier decisions
            extra["head_input"] = h
        if self.value_head is not None:
            extra["value"] = self.value_head(h.detach()).squeeze(-1).float()
        return Boundaries(starts=starts, log_probs=log_probs, probs=probs, extra=extra)

    def _log_probs(self, starts, logits, probs):
        """log pi of the decisions ``starts``: of the draw's own probability while exploring."""
        if self._share(self.options.explore) is not None:
            return torch.where(starts, probs.log(), torch.log1p(-probs))
        return torch.where(starts, F.logsigmoid(logits), F.logsigmoid(-logits))

    def taken(self, b, starts):
        """The log-probabilities of the decisions the model took (some starts dropped by the packed layout): with
        window > 1 each decision's probability conditioned on the earlier decisions taken."""
        if self.window_head is not None:
            b.extra["logits"] = self.logits(b.extra["head_input"],
                                            self.previous_decisions(starts, self.options.window, b.forced))
            b.probs = torch.sigmoid(b.extra["logits"])
        b.starts = starts
        b.log_probs = self._log_probs(starts, b.extra["logits"], b.probs)

    def loss(self, b, ce_full, ce_early, mask):
        o = self.options
        reward = (ce_early - ce_full) if o.early_exit_reward else -ce_full
        reward = reward.detach().float() * mask
        across = o.baseline_scope == "data_parallel" and self.training  # evaluation: no collective
        if self.training and o.estimator == "disarm":
            return self._disarm_loss(b, reward, ce_full, ce_early, mask)
        if self.training and self.samples > 1:  # rows i*K .. i*K+K-1 are samples of one sequence
            adv = rl.group_baseline(reward, mask, self.samples)
        elif o.batch_baseline:
            adv = rl.batch_baseline(reward, mask, across_ranks=across, leave_one_out=o.leave_one_out)
        else:
            adv = reward
        returns = rl.discounted_returns(adv, self.gamma_now(), resets=b.resets)
        decisions = mask & ~b.forced  # b_1 (and every forced start) is no decision: no gradient
        terms = {}
        if self.value_head is not None:
            value = b.extra["value"]
            terms["value_loss"] = o.lambda_value * rl.masked_mean((value - returns) ** 2, decisions)
            returns = returns - value.detach()
        if o.normalize_advantage:
            returns = rl.normalize(returns, decisions)
        on = self._on(ce_full, ce_early, mask)
        weight = o.lambda_policy * on
        logits = b.extra["logits"]
        terms["policy_loss"] = rl.policy_loss(b.log_probs, returns, decisions, weight)
        terms["rate_loss"] = rl.rate_loss(logits, b.probs, mask, self.target_rate, o.lambda_rate * on,
                                          per_sequence=o.rate_scope == "sequence")
        self._entropy_term(terms, logits, decisions, on)
        b.extra["rows"] = score_rows(returns.detach() * self._score(b), decisions, b.extra["sbw"],
                                     returns=returns, reward=reward, logits=logits)
        return terms

    def _score(self, b) -> torch.Tensor:
        """d log pi(b_t) / d logit_t of each decision taken: b - p, or with explore (drawn from
        p' = (1 - eps) p + eps rho) (1 - eps) p (1 - p) (b / p' - (1 - b) / (1 - p'))."""
        starts, drawn = b.starts.float(), b.probs.detach().float()
        eps = self._share(self.options.explore)
        if eps is None:
            return starts - drawn
        p = torch.sigmoid(b.extra["logits"].detach().float())
        return (1 - eps) * p * (1 - p) * (starts / drawn - (1 - starts) / (1 - drawn))

    def _on(self, ce_full, ce_early, mask):
        """What the policy's terms (policy, rate, entropy) are multiplied by: 0 before start_step; with
        start_margin, from then on the latch; else 1 (in training a 0/1 tensor on the device)."""
        learning = self.learning()
        if self.options.start_margin is None:
            return 1.0 if learning is True else learning
        return learning * self._latch_start((ce_early - ce_full).detach().float() * mask, mask, learning)

    def _entropy_term(self, terms: dict, logits: torch.Tensor, decisions: torch.Tensor, on) -> None:
        """entropy_loss = entropy x (its share now) x the mean over decisions of KL(Bernoulli(p_t) ||
        Bernoulli(rho)): the entropy of p_t, less its cross-entropy with the target rate rho."""
        weight = self._share(self.options.entropy)
        if weight is not None:
            terms["entropy_loss"] = weight * on * rl.masked_mean(rl.bernoulli_kl(logits, self.target_rate), decisions)

    def _disarm_loss(self, b, reward, ce_full, ce_early, mask):
        """The policy term from antithetic pairs (rows 2i, 2i + 1): the surrogate -lambda mean(g_t logit_t)
        over the pair's decisions, whose gradient is -lambda g_t per logit (rl.disarm_credit)."""
        o = self.options
        returns = rl.discounted_returns(reward, self.gamma_now(), resets=b.resets)
        logits = b.extra["logits"]
        g = rl.disarm_credit(returns, b.starts, logits[0::2].detach())
        decisions = (mask & ~b.forced)[0::2]
        on = self._on(ce_full, ce_early, mask)
        weight = o.lambda_policy * on
        terms = {"policy_loss": -weight * rl.masked_mean(g.detach() * logits[0::2], decisions),
                 "rate_loss": rl.rate_loss(logits, b.probs, mask, self.target_rate, o.lambda_rate * on,
                                           per_sequence=o.rate_scope == "sequence")}
        self._entropy_term(terms, logits, mask & ~b.forced, on)
        # the statistics' score terms: each pair's g at its decisions, in both of its rows
        b.extra["rows"] = score_rows(g.repeat_interleave(2, 0), mask & ~b.forced, b.extra["sbw"], returns=returns,
                                     reward=reward, logits=logits)
        return terms

    def _latch_start(self, gap: torch.Tensor, mask: torch.Tensor, learning) -> torch.Tensor:
        """1.0 if the policy's terms are on for this micro-batch, else 0.0 (a float tensor on the device, read
        by no one on the host): the latch as it stood before it (so the switch never depends on this batch's
        own samples), then updated: this batch's mean CE_early - CE_full in bits per byte (whatever the reward
        option; averaged over ranks, so every rank's latch, which checkpoints save, is the same) enters the
        moving average gap_ema (decay start_ema), and the latch turns on once that average exceeds
        start_margin. Once on, it stays on: the update is an or. Updated only while ``learning`` (from
        start_step on), so the gap of the first steps (the early-exit head still far behind) never enters the
        average."""
        on = self.started.float()
        if self.training:
            sums = torch.stack([gap.sum(), mask.float().sum()]).double()
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.all_reduce(sums)
            batch = (sums[0] / sums[1].clamp(min=1) / math.log(2)).float()
            decay = self.options.start_ema
            now = learning > 0
            self.gap_ema.copy_(torch.where(now, self.gap_ema * decay + (1 - decay) * batch, self.gap_ema))
            self.started.logical_or_(now & (self.gap_ema > self.options.start_margin))
        return on


@torch.no_grad()
def score_rows(u, decisions, sbw, **traced) -> dict[str, torch.Tensor]:
    """Per-row sums of the estimator's per-decision terms u_t (the estimate of the gradient with respect to
    the logit: positive pushes p_t up; G_t (b_t - p_t) for the score function), over decisions at spaces
    before a word and elsewhere: the training row's snr_sbw / snr_other (mean / standard deviation of u
    per decision; 1 / snr^2 decisions make one standard error), and u_sbw / u_other (the mean of u). Each
    of ``traced`` ([B, T]: returns, reward, logits) summed over the same decisions: the row's ret_sbw,
    reward_other, logit_sbw, ... (means per decision)."""
    u = u.float()
    rows = {}
    for cls, where in (("sbw", decisions & sbw), ("other", decisions & ~sbw)):
        w = where.float()
        rows.update({f"score_{cls}": (u * w).sum(1).double(), f"score2_{cls}": (u * u * w).sum(1).double(),
                     f"{cls}_decisions": w.sum(1).double()})
        for name, v in traced.items():
            rows[f"{name}_{cls}_sum"] = (v.float() * w).sum(1).double()
    return rows
