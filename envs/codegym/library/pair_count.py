"""CodeGym environment: count index pairs whose values sum to a target."""

from codegym_runtime import CodeGymEnv, tool


class PairCount(CodeGymEnv):
    """Count the pairs of positions i < j in a hidden array whose values sum to the target.
    Observe gives the length and target; GetElement reads values. Finish with Done(answer)."""

    CONFIGS = [
        {"nums": [1, 5, 7, -1, 5], "target": 6},
        {"nums": [1, 1, 1, 1], "target": 2},
        {"nums": [3, 4, 2], "target": 100},
    ]

    def __init__(self, nums: list, target: int):
        self.nums = list(nums)
        self.target = target

    def get_ref_answer(self):
        n = len(self.nums)
        return sum(
            self.nums[i] + self.nums[j] == self.target for i in range(n) for j in range(i + 1, n)
        )

    @tool
    def Observe(self) -> str:
        """Describe the task instance (length and target)."""
        return f"length={len(self.nums)} target={self.target}"

    @tool
    def GetElement(self, index: int) -> str:
        """Read one element.

        Args:
            index: Zero-based position.
        """
        return str(self.nums[index])

    def solve(self):
        fields = dict(part.split("=") for part in self.Observe().split())
        values = [int(self.GetElement(i)) for i in range(int(fields["length"]))]
        target = int(fields["target"])
        count = sum(
            values[i] + values[j] == target
            for i in range(len(values))
            for j in range(i + 1, len(values))
        )
        return self.Done(str(count))
