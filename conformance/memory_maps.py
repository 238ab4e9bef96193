"""The kernel's own account of this process's memory, for tests of where tensors lie."""


def advised_huge(address: int) -> bool:
    """Whether the mapping that holds `address` is advised MADV_HUGEPAGE: "hg" among its
    VmFlags in /proc/self/smaps (Linux)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return "hg" in line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")
