"""`glm5next describe-plan` and the tuner's merging of choices whose launches are equal (no GPU)."""

from pathlib import Path

import pytest

from glm5next.bench.slice import GLM53_FLASH_TEXT
from glm5next.cli import main
from glm5next.config import Glm5NextConfig
from glm5next.specialized_decode.describe import _weights, merge_equal_choices, stage_launches
from glm5next.specialized_decode.policy import STAGES


@pytest.fixture(scope="module")
def real():
    config = Glm5NextConfig.from_dict(dict(GLM53_FLASH_TEXT))
    return config, _weights(config)


def test_describe_plan_prints_every_stage_at_each_token_count(capsys):
    assert main(["describe-plan", "--tokens", "1,8,64"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    for T in (1, 8, 64):
        stages = {line.split()[0] for line in lines if f"T={T} " in line}
        assert stages == set(STAGES), T
    assert all("grid=" in line for line in lines if "(stock module)" not in line)


def test_every_choice_of_a_stage_launches_differently_where_it_means_something(real):
    """The projection, boundary and MLP choices each launch something their siblings do not (a choice
    equal to another everywhere would be a name without a kernel)."""
    config, w = real
    for stage in ("boundary", "kda_proj", "dsa_proj", "dense_mlp", "shared_expert"):
        for T in (1, 24, 64):
            plans = [stage_launches(w, config, stage, c, T) for c in STAGES[stage]]
            assert all(a != b for i, a in enumerate(plans) for b in plans[i + 1:]), (stage, T)


def test_merge_names_equal_launches_by_the_first_choice(real):
    """At the real vocabulary the LM head's split-K heuristic launches unsplit, as "gemv" does: "splitk" is
    merged into "gemv"; distinct choices and stock stay as measured; a small vocabulary, where the heuristic
    does split, keeps "splitk" (the counter-example)."""
    config, _ = real
    tables = {"logits_head": {"1": "splitk", "8": "gemv"}, "kda_proj": {"1": "grouped-early", "8": "stock"}}
    merged = merge_equal_choices(tables, config)
    assert merged == {"logits_head": {"1": "gemv", "8": "gemv"}, "kda_proj": {"1": "grouped-early", "8": "stock"}}
    small = Glm5NextConfig.from_dict(dict(GLM53_FLASH_TEXT, vocab_size=4096, num_hidden_layers=4,
                                          first_k_dense_replace=1))
    assert merge_equal_choices({"logits_head": {"1": "splitk"}}, small) == {"logits_head": {"1": "splitk"}}


def test_readme_shows_the_printers_output(capsys):
    """README's plan at 1, 8 and 64 tokens is what `describe-plan` prints now, and its short excerpt is a part of
    it (a policy or plan change that does not update the README fails here)."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    marker = "<!-- describe-plan --tokens 1,8,64"
    full = readme[readme.index(marker):].split("```\n")[1]
    assert main(["describe-plan", "--tokens", "1,8,64"]) == 0
    assert full == capsys.readouterr().out
    intro = readme.index("`glm5next describe-plan [--tokens 1,8,64] [--policy FILE]` prints")
    excerpt = readme[intro:].split("```\n")[1].splitlines()
    assert excerpt and set(excerpt) <= set(full.splitlines())
