"""CodeGym environment: locate a target in a hidden sorted array by comparisons."""

from codegym_runtime import CodeGymEnv, tool


class BinarySearch(CodeGymEnv):
    """A hidden sorted array contains the target exactly once. Find its zero-based index.
    Observe gives the length; Compare(index) says whether the element there is less than,
    equal to or greater than the target. Finish with Done(answer)."""

    CONFIGS = [
        {"nums": [1, 3, 5, 7, 9, 11, 13], "target": 9},
        {"nums": [2, 4, 8, 16, 32, 64, 128, 256], "target": 2},
        {"nums": [10, 20, 30], "target": 30},
    ]

    def __init__(self, nums: list, target: int):
        self.nums = sorted(nums)
        self.target = target
        self.comparisons = 0

    def get_ref_answer(self):
        return self.nums.index(self.target)

    @tool
    def Observe(self) -> str:
        """Describe the array (its length)."""
        return f"length={len(self.nums)}"

    @tool
    def Compare(self, index: int) -> str:
        """Compare the element at index with the target: 'less', 'equal' or 'greater'.

        Args:
            index: Zero-based position.
        """
        self.comparisons += 1
        value = self.nums[index]
        return "equal" if value == self.target else ("less" if value < self.target else "greater")

    def solve(self):
        lo, hi = 0, int(self.Observe().split("=")[1]) - 1
        while lo <= hi:
            mid = (lo + hi) // 2
            verdict = self.Compare(mid)
            if verdict == "equal":
                return self.Done(str(mid))
            lo, hi = (mid + 1, hi) if verdict == "less" else (lo, mid - 1)
        return self.Done("-1")
