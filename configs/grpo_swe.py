"""DeepSWE-style baseline: GRPO + rejection sampling on R2E-Gym rows, SGLang, Docker.

64 tasks x 8 rollouts per step, at most 50 agent steps, clip-high 0.28, no KL,
leave-one-out advantages without std normalisation, all-pass / all-fail groups
dropped. Weights come from a HF Qwen3 directory; SGLang serves them with tensor
parallelism and receives the trained weights through /update_weights_from_disk.

    python train.py --config configs/grpo_swe.py:model_path=/models/Qwen3-14B \\
        --workdir /ckpt/grpo_swe
    python train.py --config configs/grpo_swe.py --workdir /tmp/x --dry_run

Options (`OPTIONS`): model (a models.qwen3 preset), model_path (HF directory),
train/eval (JSONL of R2E-Gym or SWE-bench rows), tp (SGLang tensor parallel size),
servers, seed. The recipes built on this file pass their own option defaults, so an
option given on the command line replaces only itself.
"""

import ml_collections

from configs import common

OPTIONS = dict(model="qwen3-14b", model_path="/models/Qwen3-14B",
               train="data/r2e_gym_subset.jsonl", eval="data/swe_bench_verified.jsonl", tp=2,
               servers=2, seed=0)


def get_config(arg=None, options=OPTIONS):
    """`options`: the option defaults (a recipe's own, e.g. its model)."""
    arg = common.parse_arg(arg, **options)
    c = ml_collections.ConfigDict()
    c.seed = arg.seed
    c.total_steps = 200

    # bf16 compute, f32 master parameters and Adam state; each layer's activations are
    # recomputed in the backward pass (remat none / full / save-dots / nested); "nested"
    # keeps only every ~sqrt(layers)-th layer input (qwen3-8b at 32k: 38.7 GiB per device
    # against 49.6 with "full", bench.scale); attention "auto" is the Pallas kernel on
    # GPU/TPU (logged if it falls back), "pallas" requires it.
    c.model = dict(preset=arg.model, hf_path=arg.model_path, dtype="bfloat16",
                   param_dtype="float32", remat="nested", attention="auto")
    c.tokenizer = dict(path=arg.model_path, bpe_vocab_size=0)
    c.mesh = dict(data=1, fsdp=-1, tensor=1)
    c.distributed = common.distributed_defaults()  # one process per host: rl.distributed

    # Launched beside the learner on one 8-GPU host: the servers take the last
    # servers x tp GPUs, the learner the rest (README: placement).
    c.engine = common.engine_defaults()
    c.engine.update(kind="sglang", max_batch=0, max_len=40960)
    c.engine.sglang.update(launch=True, ports=tuple(30000 + i for i in range(arg.servers)),
                           tp_size=arg.tp, extra_args=("--dtype", "bfloat16"))

    c.env = dict(backend="docker", tasks=f"{arg.train}|{arg.eval}", train_tasks=0,
                 eval_tasks=500, difficulties=(), task_seed=0, eval_seed=0, image="",
                 max_concurrent=512, tools_in_prompt=True,
                 # SWE-bench rows without an image: "" = the published SWE-bench images
                 # (env.swebench.SWEBENCH_IMAGE_TEMPLATE); fields {instance_id},
                 # {instance_id_lower}, {instance_id_1776}.
                 image_template="", latency=common.latency_defaults(),
                 **common.sandbox_defaults())

    # Qwen3 checkpoints allow 40,960 positions (max_position_embeddings).
    c.rollout = dict(max_steps=50, max_turn_tokens=4096, max_response_tokens=32768,
                     max_context=40960, wall_timeout_s=3600.0, temperature=1.0, top_p=1.0,
                     top_k=-1, test_timeout_s=600.0, env_retries=2, grade_cache=True,
                     grading=common.GRADING, system_prompt=common.SYSTEM_PROMPT,
                     **common.staleness_defaults())

    c.algo = "grpo"
    c.advantage = "rloo"
    c.reject_degenerate = True
    c.batch_tasks = 64
    c.group_size = 8

    c.ps = common.prefix_defaults(enabled=False)
    c.spo = common.spo_defaults()
    _learner(c)
    c.sft = dict(steps=0, batch_size=0, lr=0.0, warmup_steps=0, end_lr_frac=0.0, num_demos=0,
                 imperfect_share=0.0, explore_share=0.0, max_steps=0)
    _schedule(c)
    return common.lock(c)


def _learner(c) -> None:
    c.learner = common.learner_defaults()
    c.learner.seed = c.get_ref("seed")
    c.learner.temperature = c.rollout.get_ref("temperature")
    c.learner.num_minibatches = 4
    c.learner.num_microbatches = 16
    c.learner.optim.lr = 1e-6
    c.learner.optim.warmup_steps = 10
    c.learner.optim.weight_decay = 0.01
    c.learner.loss.agg = "seq-mean-token-sum"
    c.learner.loss.eps_low, c.learner.loss.eps_high = 0.2, 0.28
    c.learner.loss.kl, c.learner.loss.kl_coef = "none", 0.0
    c.learner.row_buckets = (16384, 32768, 40960)
    # The bf16 SGLang sampler's log-probs differ from the learner's: the PPO ratio uses
    # the learner's own old log-probs, with truncated importance weights against the
    # sampler's (rl.loss.offpolicy_weights).
    c.learner.loss.old_logprobs, c.learner.loss.tis_cap = "learner", 2.0


def _schedule(c) -> None:
    """Evaluation, checkpoints, logs and the env-error stop."""
    c.eval_every = 10
    c.eval_temperature = 0.0
    c.ckpt_every = 5
    # Also a checkpoint once ckpt_every_s seconds of the run have passed since the last
    # (0: by step only), for comparisons at equal wall clock (evaluated afterwards with
    # train.py --eval_only --eval_step N); ckpt_keep counts them too.
    c.ckpt_every_s = 0.0
    c.ckpt_keep = 3
    c.log_texts_every = 5
    # Stop, with an error and a non-zero exit, after this many RL steps in a row whose
    # rollouts were all env errors (nothing scored, nothing trained); 0: never stop.
    c.max_env_error_steps = 3
