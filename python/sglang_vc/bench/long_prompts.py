"""Long prompts of real text for the long-context benchmarks (``bench.throughput``,
``bench.remote_prefix``): prompts that share nothing, or one shared document with a
question after it each (the radix cache prefills the document once)."""

from __future__ import annotations

# Questions put after a shared document (``shared_document_prompts``): a request each.
QUESTIONS = (
    "Summarize the text above in three sentences.",
    "What is the main subject of the text above?",
    "List the names, terms and numbers that the text above mentions.",
    "Which part of the text above is the most technical? Explain it simply.",
    "Write a short title for each section of the text above.",
    "What would a reader need to know before reading the text above?",
    "Quote the sentence of the text above that matters most, and say why.",
    "Write three questions that the text above answers, with their answers.",
    "Rewrite the first paragraph of the text above for a child.",
    "What does the text above leave out that a reader might expect?",
    "Translate the last paragraph of the text above into plain language.",
    "Which claims in the text above could be checked, and how?",
)


def _text_stream(model_dir: str, tokens: int, n_items: int) -> list[int]:
    """Token ids of the reading workload's texts (real text on the machine), at least
    ``tokens`` of them where the machine has that much."""
    from transformers import AutoTokenizer

    from sglang_vc.bench.workloads import load_workload

    tok = AutoTokenizer.from_pretrained(model_dir)
    stream: list[int] = []
    for item in load_workload("reading", tokenizer=model_dir, max_tokens=2048, n=n_items):
        stream += tok(item["prompt"])["input_ids"]
        if len(stream) >= tokens:
            break
    return stream


def build_prompts(model_dir: str, n: int, prompt_tokens: int) -> list[list[int]] | None:
    """``n`` prompts of exactly ``prompt_tokens`` tokens, cut at different offsets from the
    token stream of the reading workload (real text on the machine): no two share a
    prefix, so the radix cache cannot serve one from another."""
    stream = _text_stream(model_dir, n * prompt_tokens, 4 * n)
    step = max(1, (len(stream) - prompt_tokens) // max(1, n - 1)) if len(stream) >= prompt_tokens else 0
    prompts = [stream[i * step : i * step + prompt_tokens] for i in range(n)]
    if not step or any(len(p) < prompt_tokens for p in prompts) or len({tuple(p[:8]) for p in prompts}) < n:
        return None
    return prompts


def shared_document_prompts(model_dir: str, n: int, document_tokens: int) -> list[list[int]] | None:
    """``n`` prompts of one document of exactly ``document_tokens`` tokens (real text),
    each followed by a different question (:data:`QUESTIONS`): they share the document as
    a prefix, so the radix cache prefills it once and every request decodes over it."""
    from transformers import AutoTokenizer

    if n > len(QUESTIONS):
        return None
    stream = _text_stream(model_dir, document_tokens, max(8, document_tokens // 1024))
    if len(stream) < document_tokens:
        return None
    tok = AutoTokenizer.from_pretrained(model_dir)
    doc = stream[:document_tokens]
    return [doc + tok("\n\nQuestion: " + q + "\nAnswer:", add_special_tokens=False)["input_ids"]
            for q in QUESTIONS[:n]]
