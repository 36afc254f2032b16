"""How every system of one benchmark run picks its tokens: greedy (the default) or sampled, at one setting for all
(`retrace bench --temperature T --top-p P --top-k K --seed S`; Qwen3's suggested non-thinking setting is
0.7 / 0.8 / 20). Each system samples through its own library, every other sampler of that library turned off:

- ours: `SamplingParams(temperature, top_p, top_k, seed=S + i)` for prompt i;
- transformers (`hf-*`): `generate(do_sample=True, temperature, top_p, top_k)` after `torch.manual_seed(S + i)`,
  i the chunk's first prompt;
- onnxruntime-genai: `set_search_options(do_sample=True, temperature, top_p, top_k, random_seed=S + i)`;
- llama-cpp-python: `generate(temp, top_p, top_k, min_p=0)` after `set_seed(S + i)`; its sampler applies top-p
  before the temperature (a fixed order), so at T < 1 it keeps more tokens than the others;
- llama-server: `/completion` with `temperature, top_p, top_k, min_p: 0, seed: S + i` and `samplers: top_k,
  temperature, top_p` (the others' order).

A top-k of 0 and a top-p of 1 mean off everywhere. Sampled outputs differ between systems by design (each draws
its own tokens), so a sampled run compares no outputs: that speculative sampling keeps the target's distribution
is what the test suite's chi-square tests check (tests/test_runtime_sampling.py, tests/test_lookup_sampling.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from retrace.runtime.sampling_params import SamplingParams


@dataclass(frozen=True)
class Decoding:
    temperature: float = 0.0  # 0: greedy (then top_p, top_k and seed are unused)
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0  # prompt i samples with seed + i in every run, so the runs of a system draw alike

    def __post_init__(self) -> None:
        p = SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed)
        object.__setattr__(self, "temperature", p.temperature)  # the request check's normalisation (tiny T: 0)

    @classmethod
    def of(cls, cfg) -> Decoding:
        """The decoding of a BenchConfig (its flat `temperature`, `top_p`, `top_k`, `seed` fields)."""
        return cls(cfg.temperature, cfg.top_p, cfg.top_k, cfg.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def describe(self) -> str:
        if self.greedy:
            return "greedy"
        return (f"sampled (temperature {self.temperature:g}, top-p {self.top_p:g}, top-k {self.top_k or 'off'}, "
                f"seeds {self.seed} + prompt index)")

    def to_dict(self) -> dict:
        return {"greedy": self.greedy, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "seed": self.seed}

    # ------------------------------------------------------------------------------------------ per library
    def params(self, n: int, index: int) -> SamplingParams:
        """Ours: exactly n tokens (EOS ignored, as every system of the bench)."""
        if self.greedy:
            return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
        return SamplingParams(max_new_tokens=n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              seed=self.seed + index, ignore_eos=True)

    def hf_kwargs(self) -> dict:
        """transformers' generate() options (its draws come from torch's global generator: `seed_torch`)."""
        if self.greedy:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}

    def seed_torch(self, index: int) -> None:
        """Seed torch's global generator for a sampled transformers call starting at prompt `index`."""
        if not self.greedy:
            import torch

            torch.manual_seed(self.seed + index)

    def genai_options(self, index: int) -> dict:
        """onnxruntime-genai's search options (top_k 0: off, as in its sampler's dispatch)."""
        if self.greedy:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "random_seed": self.seed + index}

    def llama_cpp_kwargs(self) -> dict:
        """llama-cpp-python's Llama.generate sampler options (the seed: Llama.set_seed before each prompt)."""
        if self.greedy:
            return {"top_k": 1, "top_p": 1.0, "min_p": 0.0, "temp": 0.0, "repeat_penalty": 1.0}
        return {"top_k": self.top_k, "top_p": self.top_p, "min_p": 0.0, "temp": self.temperature,
                "repeat_penalty": 1.0}

    def llama_server_body(self, index: int) -> dict:
        """llama-server's /completion sampling fields."""
        if self.greedy:
            return {"temperature": 0.0, "top_k": 1}
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": 0.0,
                "seed": self.seed + index, "samplers": ["top_k", "temperature", "top_p"]}


GREEDY = Decoding()
