"""CodeGym environment: maximum subarray sum, built from Kadane's algorithm."""

from codegym_runtime import CodeGymEnv, tool


class MaxSubarray(CodeGymEnv):
    """Find the largest sum of a non-empty contiguous subarray of a hidden integer array.
    Use Observe to learn its length and GetElement to read values; Add and Max help you compute.
    Finish with Done(answer)."""

    CONFIGS = [
        {"nums": [-2, 1, -3, 4, -1, 2, 1, -5, 4]},
        {"nums": [1, 2, 3]},
        {"nums": [-3, -1, -2]},
        {"nums": [5, -9, 6, -2, 3]},
    ]

    def __init__(self, nums: list):
        self.nums = list(nums)
        self.reads = 0

    def get_ref_answer(self):
        best = cur = self.nums[0]
        for x in self.nums[1:]:
            cur = max(x, cur + x)
            best = max(best, cur)
        return best

    @tool
    def Observe(self) -> str:
        """Describe the array (its length)."""
        return f"The array has {len(self.nums)} elements."

    @tool
    def GetElement(self, index: int) -> str:
        """Read one element.

        Args:
            index: Zero-based position.
        """
        self.reads += 1
        return str(self.nums[index])

    @tool
    def Add(self, a: int, b: int) -> str:
        """Return a + b.

        Args:
            a: First addend.
            b: Second addend.
        """
        return str(a + b)

    @tool
    def Max(self, a: int, b: int) -> str:
        """Return the larger of a and b.

        Args:
            a: First value.
            b: Second value.
        """
        return str(max(a, b))

    def solve(self):
        n = int(self.Observe().split()[3])
        best = cur = int(self.GetElement(0))
        for i in range(1, n):
            x = int(self.GetElement(i))
            cur = int(self.Max(x, int(self.Add(cur, x))))
            best = int(self.Max(best, cur))
        return self.Done(str(best))
