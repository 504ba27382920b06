"""SpecCache from SGLang's frontend language: the retrieved documents are marked with the
separator, so the server reuses their KV and recomputes only the tokens SpecCache picks.

    python -m sglang_vc.launch_server --speccache-selector speccache --port 30000 &
    python examples/speccache_rag.py http://127.0.0.1:30000
"""

import sys

import sglang as sgl

SEP = "<|vc_chunk|>"  # the server's --speccache-separator
DOCS = [
    "The Zephyr-7 probe was launched in 2031 from Kourou. It studies the ice moons of Saturn.",
    "Kourou is a town in French Guiana. Europe's spaceport is there.",
]


@sgl.function
def rag(s, question):
    s += "Answer the question from the documents.\n" + SEP + SEP.join(d + "\n" for d in DOCS) + SEP
    s += "Question: " + question + "\nAnswer:"
    s += sgl.gen("answer", max_tokens=16, temperature=0, stop="\n")


if __name__ == "__main__":
    sgl.set_default_backend(sgl.RuntimeEndpoint(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:30000"))
    state = rag.run(question="When was the Zephyr-7 probe launched?")
    print(state["answer"].strip())
