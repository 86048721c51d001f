"""Chat prompts for the demo and the benchmark (short, varied, answerable by a small model)."""

CHAT_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "Explain what a CPU cache is to a ten-year-old.",
    "Give me three tips for learning a new language.",
    "What is the difference between a list and a tuple in Python?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "Why is the sky blue?",
    "Write a short, friendly email declining a meeting invitation.",
    "List the planets of the solar system in order from the sun.",
    "How do I boil an egg?",
    "What are the benefits of regular exercise?",
    "Translate 'good morning, how are you?' into Spanish and French.",
    "Describe a cat to someone who has never seen one.",
    "What is photosynthesis?",
    "Suggest a name for a bakery and explain why.",
    "How does a bicycle stay upright?",
]
