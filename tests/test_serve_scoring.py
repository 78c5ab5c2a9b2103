"""What evaluation harnesses send: greedy at temperature 0, ``echo``, ``prompt_logprobs``, ``max_tokens`` 0.

lm-evaluation-harness's ``local-completions`` scores a text by asking ``echo`` with ``logprobs``
(and ``max_tokens`` 1, temperature 0) and reading the prompt's log-probabilities; its generation
tasks ask temperature 0 for the target's greedy answer. The tiny pair checks shapes and values
against a plain forward; the embedded pair in float32 checks greedy against AR greedy.
"""

from __future__ import annotations

import pytest
import torch
from test_serve_http import MODEL, error_of, ids_of, served

from smcsd_ppl.config import SMCConfig

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 9, 13, 2, 40], [7, 7, 100, 3]]


@pytest.fixture(scope="module")
def server(tiny_smcsd):
    with served(tiny_smcsd) as client:
        yield client


def plain(model, ids) -> torch.Tensor:
    """log p of each token after the first, at T = 1, from one plain forward (``[len - 1]``)."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_echo_gives_the_prompt_s_log_probabilities_then_the_output_s(tiny_smcsd, server):
    ask = {"model": MODEL, "prompt": PROMPTS, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    reply = server.post("/v1/completions", json=ask | {"return_tokens_as_token_ids": True}).json()
    for prompt, choice in zip(PROMPTS, reply["choices"]):
        scores = choice["logprobs"]
        ids = ids_of(scores["tokens"])
        assert ids[:-1] == prompt and len(ids) == len(prompt) + 1  # lm-eval reads [ctxlen:-1]
        assert scores["token_logprobs"][0] is None and scores["top_logprobs"][0] is None
        want = plain(tiny_smcsd.target.model, ids)  # greedy's scores are the model's own
        assert torch.tensor(scores["token_logprobs"][1:]) == pytest.approx(want, abs=1e-4)
        assert choice["text"] == tiny_smcsd.decode(ids)
        top = scores["top_logprobs"][-1]  # the greedy token is the likeliest
        assert (
            list(top) == [f"token_id:{ids[-1]}"]
            and top[f"token_id:{ids[-1]}"] == scores["token_logprobs"][-1]
        )
    assert reply["usage"] == {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}


def test_max_tokens_zero_scores_the_prompt_and_returns_no_token(tiny_smcsd, server):
    ask = {"model": MODEL, "prompt": "The quick brown fox", "echo": True, "logprobs": 0, "max_tokens": 0}
    reply = server.post("/v1/completions", json=ask).json()
    choice = reply["choices"][0]
    ids = tiny_smcsd.tokenizer("The quick brown fox")["input_ids"]
    assert choice["text"] == "The quick brown fox" and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["token_logprobs"]) == len(ids)
    want = plain(tiny_smcsd.target.model, ids)
    assert torch.tensor(choice["logprobs"]["token_logprobs"][1:]) == pytest.approx(want, abs=1e-4)
    assert reply["usage"]["completion_tokens"] == 0
    empty = server.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 0}).json()["choices"][0]
    assert empty["text"] == "" and empty["logprobs"] is None


def test_prompt_logprobs_rank_and_name_each_prompt_token_as_vllm_does(tiny_smcsd, server):
    reply = server.post("/v1/completions", json={"prompt": PROMPTS[0], "prompt_logprobs": 2, "max_tokens": 2})
    field = reply.json()["choices"][0]["prompt_logprobs"]
    assert field[0] is None and len(field) == len(PROMPTS[0])
    with torch.inference_mode():
        logits = tiny_smcsd.target.model(input_ids=torch.tensor([PROMPTS[0]])).logits[0, :-1]
    log_p = torch.log_softmax(logits.float(), -1)
    for at, entry in enumerate(field[1:]):
        token = PROMPTS[0][at + 1]
        own = entry[str(token)]
        assert own["logprob"] == pytest.approx(log_p[at, token].item(), abs=1e-4)
        assert own["rank"] == int((log_p[at] > log_p[at, token]).sum()) + 1
        best = log_p[at].topk(2).indices.tolist()
        assert {int(t) for t in entry} == {token, *best} and entry[str(best[0])]["rank"] == 1
    chat = {"messages": [{"role": "user", "content": "Hi"}], "prompt_logprobs": 0, "max_tokens": 1}
    answer = server.post("/v1/chat/completions", json=chat).json()
    hi = tiny_smcsd.tokenizer("Hi")["input_ids"]  # no chat template: the message's text
    assert answer["prompt_logprobs"][0] is None and len(answer["prompt_logprobs"]) == len(hi) > 1


def test_scoring_is_answered_whole_and_refused_in_a_stream(server):
    for extra in ({"echo": True}, {"prompt_logprobs": 1}, {"max_tokens": 0}):
        reply = server.post("/v1/completions", json={"prompt": "Hi", "stream": True} | extra)
        assert "ask without stream" in error_of(reply, 400)["message"]
    reply = server.post("/v1/completions", json={"prompt": "Hi", "prompt_logprobs": 21})
    assert error_of(reply, 400)["param"] == "prompt_logprobs"


TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, there was",
    "The three primary colors are",
    "To make a cup of tea, first",
    "Water boils at",
    "The largest planet in the solar system is",
    "In 1969, the first person to walk on the moon was",
    "A haiku about autumn:",
    "The opposite of hot is",
]


@pytest.mark.slow
def test_temperature_zero_through_the_server_gives_ar_greedy_s_tokens(default_smcsd_f32):
    pair, budget = default_smcsd_f32, 16
    prompts = [pair.tokenizer(t)["input_ids"] for t in TEXTS]
    greedy = SMCConfig(target_temperature=0, max_new_tokens=budget)
    want = [g.token_ids for g in pair.generate_ids(prompts, method="ar", config=greedy)]
    with served(pair, defaults=SMCConfig(n_particles=4, block_size=4), model_name="m") as client:
        ask = {"max_tokens": budget, "temperature": 0, "logprobs": 0, "return_tokens_as_token_ids": True}
        got = [
            ids_of(
                client.post("/v1/completions", json=ask | {"prompt": p}).json()["choices"][0]["logprobs"][
                    "tokens"
                ]
            )
            for p in prompts
        ]
    assert got == want
