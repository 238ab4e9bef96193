"""POST /v1/embeddings on a real server (infer.server.routes_embeddings), through the official
openai client, langchain's OpenAIEmbeddings and litellm, each vector checked against
transformers' final hidden states (`last_hidden_state`, after the final norm) of the same
tokens, pooled and normalized; refusals by the rules of infer.server.errors."""

import base64

import numpy as np
import pytest
import torch

from .test_app_errors import assert_refused_and_still_serving, refusal

TEXTS = ["The sky is blue.", "Paris is the capital of France, and a city of museums.", "naïve café 🙂"]


def expected_vector(smollm2_transformers, token_ids: list[int], pooling: str) -> np.ndarray:
    with torch.inference_mode():
        hidden = smollm2_transformers.model(torch.tensor([token_ids])).last_hidden_state[0].float()
    pooled = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    return (pooled / pooled.norm()).numpy()


def encode(smollm2_loaded, text: str) -> list[int]:
    return smollm2_loaded.tokenizer.encode(text, add_special_tokens=True)


def assert_same_direction(vector, expected) -> None:
    vector = np.asarray(vector, dtype=np.float32)
    assert vector.shape == expected.shape
    assert abs(float(np.linalg.norm(vector)) - 1.0) < 1e-5
    np.testing.assert_allclose(vector, expected, atol=2e-4)


@pytest.fixture(scope="module")
def mean_server(start_server):
    running = start_server(max_batch_size=4, pooling_type="mean", prefill_chunk_size=8)
    yield running
    running.stop()


@pytest.mark.parametrize("encoding_format", ["float", "base64", None], ids=["float", "base64", "default"])
def test_the_openai_client_gets_each_inputs_normalized_last_token_state(
    server, smollm2_loaded, smollm2_transformers, encoding_format
):
    options = {} if encoding_format is None else {"encoding_format": encoding_format}
    answer = server.openai_client().embeddings.create(model=server.model, input=TEXTS, **options)
    assert answer.object == "list" and answer.model == server.model
    assert [item.index for item in answer.data] == [0, 1, 2]
    token_counts = [len(encode(smollm2_loaded, text)) for text in TEXTS]
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(token_counts)
    for item, text in zip(answer.data, TEXTS, strict=True):
        vector = item.embedding
        if encoding_format == "base64":  # the client hands a base64 string back as it came
            vector = np.frombuffer(base64.b64decode(vector), dtype="<f4")
        assert_same_direction(
            vector, expected_vector(smollm2_transformers, encode(smollm2_loaded, text), "last")
        )


def test_token_id_inputs_and_a_single_string(server, smollm2_loaded, smollm2_transformers):
    ids = encode(smollm2_loaded, TEXTS[1])
    client = server.openai_client()
    by_ids = client.embeddings.create(model=server.model, input=[ids, ids[:5]], encoding_format="float")
    assert_same_direction(by_ids.data[0].embedding, expected_vector(smollm2_transformers, ids, "last"))
    assert_same_direction(by_ids.data[1].embedding, expected_vector(smollm2_transformers, ids[:5], "last"))
    # Alone, the same tokens give the same vector but for float32's last bits: a batch of other
    # rows changes the CPU matmuls' shapes, and with them the order of their sums on some CPUs
    # (an Intel AVX-512 VM differed by 4e-9 where AMD ones gave equal bits).
    one = client.embeddings.create(model=server.model, input=ids, encoding_format="float")
    assert len(one.data) == 1
    np.testing.assert_allclose(one.data[0].embedding, by_ids.data[0].embedding, rtol=0, atol=1e-6)
    text = client.embeddings.create(model=server.model, input=TEXTS[1], encoding_format="float")
    np.testing.assert_allclose(text.data[0].embedding, by_ids.data[0].embedding, rtol=0, atol=1e-6)


def test_mean_pooling_over_chunks_is_the_mean_of_every_tokens_state(
    mean_server, smollm2_loaded, smollm2_transformers
):
    """Chunks of 8 tokens: the mean is summed over several steps."""
    answer = mean_server.openai_client().embeddings.create(
        model=mean_server.model, input=TEXTS, encoding_format="float"
    )
    for item, text in zip(answer.data, TEXTS, strict=True):
        ids = encode(smollm2_loaded, text)
        assert_same_direction(item.embedding, expected_vector(smollm2_transformers, ids, "mean"))
    models = mean_server.openai_client().models.list().data
    assert models[0].model_extra["pooling"] == "mean"


def test_v1_models_names_the_pooling(server):
    (model,) = server.openai_client().models.list().data
    assert model.model_extra["pooling"] == "last"


def test_langchain_and_litellm_unchanged(server, smollm2_loaded, smollm2_transformers):
    import litellm
    from langchain_openai import OpenAIEmbeddings

    embeddings = OpenAIEmbeddings(
        model=server.model,
        base_url=f"{server.base_url}/v1",
        api_key="unused",
        check_embedding_ctx_length=False,  # its tiktoken lookup is for OpenAI's own models
    )
    documents = embeddings.embed_documents(TEXTS[:2])
    query = embeddings.embed_query(TEXTS[2])
    for vector, text in zip([*documents, query], TEXTS, strict=True):
        assert_same_direction(
            vector, expected_vector(smollm2_transformers, encode(smollm2_loaded, text), "last")
        )
    answer = litellm.embedding(
        model=f"openai/{server.model}", input=[TEXTS[0]], api_base=f"{server.base_url}/v1", api_key="unused"
    )
    assert_same_direction(
        answer.data[0]["embedding"],
        expected_vector(smollm2_transformers, encode(smollm2_loaded, TEXTS[0]), "last"),
    )


def test_embeddings_share_steps_with_generation(server):
    """A chat answer running beside embedding requests is the one it gives alone."""
    client = server.openai_client()
    question = [{"role": "user", "content": "Name three colours."}]
    alone = client.chat.completions.create(
        model=server.model, messages=question, max_tokens=16, temperature=0
    )
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        chats = [
            pool.submit(
                client.chat.completions.create,
                model=server.model,
                messages=question,
                max_tokens=16,
                temperature=0,
            )
            for _ in range(2)
        ]
        vectors = [pool.submit(client.embeddings.create, model=server.model, input=TEXTS) for _ in range(2)]
        answers = [future.result().choices[0].message.content for future in chats]
        assert all(len(future.result().data) == 3 for future in vectors)
    assert answers == [alone.choices[0].message.content] * 2


EMBEDDINGS = "/v1/embeddings"
REFUSALS = [
    refusal(EMBEDDINGS, b"{not json", 400, "invalid_json", None),
    refusal(EMBEDDINGS, {"model": "$MODEL"}, 400, "missing_required_parameter", "input"),
    refusal(EMBEDDINGS, {"input": "hi"}, 400, "missing_required_parameter", "model"),
    refusal(EMBEDDINGS, {"model": "$MODEL", "input": ""}, 400, "empty_input", "input"),
    refusal(EMBEDDINGS, {"model": "$MODEL", "input": []}, 400, "empty_input", "input"),
    refusal(EMBEDDINGS, {"model": "$MODEL", "input": [[]]}, 400, "empty_input", "input"),
    refusal(EMBEDDINGS, {"model": "$MODEL", "input": [1, "a"]}, 400, "invalid_value", "input"),
    refusal(EMBEDDINGS, {"model": "$MODEL", "input": 3}, 400, "invalid_value", "input"),
    refusal(EMBEDDINGS, {"model": "$MODEL", "input": ["x"] * 2049}, 400, "invalid_value", "input"),
    refusal(
        EMBEDDINGS, {"model": "$MODEL", "input": "hi", "encoding_format": "int8"}, 400, "invalid_value",
        "encoding_format",
    ),
    refusal(
        EMBEDDINGS, {"model": "$MODEL", "input": "hi", "dimensions": 64}, 400, "unsupported_value",
        "dimensions",
    ),
    refusal(EMBEDDINGS, {"model": "$MODEL", "input": [10**7]}, 400, "invalid_value", "input"),
    refusal(EMBEDDINGS, {"model": "$MODEL", "input": ["ok", [10**7]]}, 400, "invalid_value", "input.1"),
    refusal(
        EMBEDDINGS, {"model": "$MODEL", "input": "hi", "pooling": "mean"}, 400, "unknown_parameter", "pooling"
    ),
    refusal(EMBEDDINGS, {"model": "$MODEL", "input": [1] * 600}, 400, "context_length_exceeded", "input"),
    refusal(EMBEDDINGS, {"model": "no-such-model", "input": "hi"}, 404, "model_not_found", "model"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "status", "code", "param"), REFUSALS)
def test_malformed_input_is_a_4xx_naming_the_field(server, path, body, status, code, param):
    still = (EMBEDDINGS, {"model": server.model, "input": "Hi"})
    assert_refused_and_still_serving(server, path, body, status, code, param, still=still)
