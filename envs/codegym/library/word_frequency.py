"""CodeGym environment: the most frequent word of a hidden text."""

from codegym_runtime import CodeGymEnv, tool


class WordFrequency(CodeGymEnv):
    """Find the most frequent word of a hidden text (ties go to the alphabetically first word).
    Observe lists the distinct words; CountWord counts one. Finish with Done(answer)."""

    CONFIGS = [
        {"text": "the cat and the dog and the bird"},
        {"text": "b a b a c"},
        {"text": "rollout farm rollout"},
    ]

    def __init__(self, text: str):
        self.words = text.split()

    def get_ref_answer(self):
        return min(set(self.words), key=lambda w: (-self.words.count(w), w))

    @tool
    def Observe(self) -> str:
        """List the distinct words of the text, sorted."""
        return " ".join(sorted(set(self.words)))

    @tool
    def CountWord(self, word: str) -> str:
        """Count how often a word occurs.

        Args:
            word: The word to count.
        """
        return str(self.words.count(word))

    def solve(self):
        words = self.Observe().split()
        best = min(words, key=lambda w: (-int(self.CountWord(w)), w))
        return self.Done(best)
