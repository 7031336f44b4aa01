"""`[eval]`: pinned evaluation of one policy version on a held-out set, every `interval` versions."""

from pydantic import Field

from slime_async.config.base import Section


class EvalConfig(Section):
    interval: int = Field(0, ge=0)
    """Evaluate the policy every this many versions on `data` (pinned: every token of every
    evaluation answer comes from that one version; the learner holds its next push until the
    evaluation is done). Version 0 (the start) and the last version are evaluated too. 0: off."""
    data: str | None = None
    """Held-out JSONL file (the same fields as generator.dataset; rewards by generator.reward).
    Relative paths resolve from the config file that sets it. Needed when `interval` > 0."""
    max_examples: int = Field(0, ge=0)
    """Evaluate on the first this many records of `data` (0: all of them)."""
    greedy: bool = True
    """Score one greedy answer (temperature 0) per record: `eval/accuracy_greedy`."""
    seed: int | None = None
    """Seeds every sampled evaluation answer: answer j of record i draws with its own sampler
    (SGLang's `sampling_seed`) seeded from (seed, i, j), the same at every version and in every
    run, so two runs that evaluate the same policy give the same answers and two policies are
    compared on common random numbers (paired runs). None in a full config: run.seed; None in a
    lone section: the engines' own random streams (unpaired)."""
    answers: bool = True
    """Write every answer's outcome to `<run_dir>/eval/answers_v<v>.jsonl` (record, kind, correct,
    length, token ids): what a paired comparison of two runs reads, problem by problem."""
    samples: int = Field(4, ge=0)
    """Answers sampled per record at `temperature` (`eval/accuracy_sampled`, the mean over all of
    them, and `eval/pass_at_k`); 0: none."""
    temperature: float | None = Field(None, gt=0)
    """Temperature of the sampled answers (None: generator.sampling.temperature)."""
    max_new_tokens: int | None = Field(None, ge=1)
    """Longest answer (None: generator.sampling.max_new_tokens)."""
    concurrency: int = Field(64, ge=1)
    """Evaluation requests in flight at once (they share the engines with the training rollouts)."""
    max_reruns: int = Field(3, ge=0)
    """An answer holding tokens of another policy version than the one evaluated (the weights
    changed under it) is generated again, at most this many times per answer (counted in
    `eval/reruns`); past that, or when the engines already serve a newer version, the whole
    evaluation of that version is discarded (counted in `eval/discarded`, never reported)."""
    hold_timeout_s: float = Field(600.0, gt=0)
    """Longest the learner holds its next weight push while the evaluation of the version the
    engines serve runs (the pin). Past it the learner stops with an error naming the version."""
