"""Compile the bundled SmolLM2 (once, cached) and generate from it with the Python API."""

import octavo

llm = octavo.LLM("smollm2-135m", dtype="bfloat16")  # an artifact directory works too
params = octavo.SamplingParams(temperature=0.0, max_tokens=48)

for output in llm.chat([[{"role": "user", "content": question}] for question in
                        ("What is the capital of France?", "Name three primary colors.")], params):
    print(output.outputs[0].text)

for output in llm.stream("The three laws of thermodynamics are", octavo.SamplingParams(max_tokens=40)):
    print(output.outputs[0].delta_text, end="", flush=True)
print()
