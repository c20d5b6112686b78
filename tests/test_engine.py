"""The user-facing surface: LLM, SamplingParams, the command line."""

import pytest

from glm5next import LLM, SamplingParams
from glm5next.cli import main


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(tiny_dir, dtype="float32", device="cpu", progress=False)


def test_generate_shapes_and_greedy_determinism(llm):
    outs = llm.generate(["Hello", {"prompt_token_ids": [72, 105, 33]}], SamplingParams(temperature=0, max_tokens=6),
                        use_tqdm=False)
    assert len(outs) == 2
    for o in outs:
        assert len(o.outputs[0].token_ids) <= 6 and isinstance(o.outputs[0].text, str)
    again = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert again[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_batched_generation_equals_alone(llm):
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompts = ["a", "a much longer prompt than the first one", "xyz"]
    together = llm.generate(prompts, params, use_tqdm=False)
    for p, t in zip(prompts, together):
        assert llm.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids == t.outputs[0].token_ids


def test_seeded_sampling_is_reproducible(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=8, seed=123, ignore_eos=True)
    a = llm.generate("seed", p, use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate(["seed", "other"], [p, SamplingParams(max_tokens=3)], use_tqdm=False)[0].outputs[0].token_ids
    assert a == b


def test_stop_string_truncates_text(llm):
    # 24 tokens of the byte-level tiny model (EOS ignored) decode to far more than the 3 characters needed.
    base = llm.generate("stop", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
    text = base.outputs[0].text
    assert len(text) >= 3, f"the fixed prompt must produce text to cut: {base.outputs[0].token_ids}"
    stop = text[2:3]
    cut = llm.generate("stop", SamplingParams(temperature=0, max_tokens=24, stop=stop, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.text == text[: text.index(stop)]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-5), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(stop=[""]), "stop"),
        (dict(min_p=1.5), "min_p"),
    ],
    ids=["negative-temperature", "zero-top-p", "bad-top-k", "zero-max-tokens", "empty-stop", "min-p-above-one"],
)
def test_impossible_sampling_parameters_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_prompts_are_refused(tiny_dir):
    llm = LLM(tiny_dir, dtype="float32", device="cpu", max_model_len=16, progress=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate("x" * 40, use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate({"prompt_token_ids": [1, 10**6]}, use_tqdm=False)
    with pytest.raises(ValueError, match="dtype"):
        LLM(tiny_dir, dtype="int8", device="cpu")


def test_cli_generate_and_make_tiny(tiny_dir, tmp_path, capsys):
    assert main(["generate", "--model", tiny_dir, "--prompt", "hi", "--max-tokens", "3", "--dtype", "float32",
                 "--device", "cpu"]) == 0
    assert "tokens/s" in capsys.readouterr().out
    assert main(["make-tiny", str(tmp_path / "t"), "--no-mtp"]) == 0
    assert (tmp_path / "t" / "config.json").exists()
    assert main(["generate", "--model", str(tmp_path / "missing"), "--prompt", "x"]) == 2
