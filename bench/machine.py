"""The machine the bench runs on: CPU model, cores, caches, memory, the git revision, and how
busy other processes keep it (before the bench and during it)."""
import datetime
import os
import platform
import re
import subprocess
import time

from bench.common import ROOT, BenchError, log


def sh(cmd):
    try:
        return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def cpu_model():
    for line in sh(["lscpu"]).splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown-cpu"


def physical_cores():
    pairs = set()
    for line in sh(["lscpu", "-p=CORE,SOCKET"]).splitlines():
        if line and not line.startswith("#"):
            pairs.add(tuple(line.split(",")))
    return len(pairs) or os.cpu_count() or 1


def logical_cpus():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def cpu_generation(family, model):
    """A short name for the core generation ("zen5", "icelake"), or "f<family>m<model>" for one
    not in this table; family and model are lscpu's numbers."""
    amd = {23: "zen2" if model >= 0x30 else "zen", 26: "zen5"}
    if family == 25:  # Zen 3 and Zen 4 share the family: Zen 4 in these model ranges
        return "zen4" if 0x10 <= model <= 0x1F or 0x60 <= model <= 0x7F or 0xA0 <= model <= 0xAF else "zen3"
    intel = {85: "skylake", 106: "icelake", 108: "icelake", 143: "sapphirerapids", 207: "emeraldrapids",
             173: "graniterapids"}
    name = amd.get(family) if family in amd else intel.get(model) if family == 6 else None
    return name or f"f{family}m{model}"


def lscpu_fields():
    """lscpu's "Key: value" lines as a dict (empty where lscpu is missing)."""
    vals = {}
    for line in sh(["lscpu"]).splitlines():
        k, _, v = line.partition(":")
        vals[k.strip()] = v.strip()
    return vals


def cpu_numbers():
    """(family, model) from lscpu, or None."""
    vals = lscpu_fields()
    try:
        return int(vals["CPU family"]), int(vals["Model"])
    except (KeyError, ValueError):
        return None


def machine_slug(model, cores, threads, numbers=None):
    """The machine's name in report files: the CPU model, and where the model name carries no
    number (a VM's "AMD EPYC"), the core generation from (family, model), so that two
    generations behind one name never write the same report."""
    s = model.lower()
    s = re.sub(r"\((r|tm)\)", "", s)
    s = re.sub(r"@.*$", "", s)                                # "@ 2.10GHz"
    s = re.sub(r"\b(\d+|[a-z]+)-cores?\b", "", s)             # "24-Cores", "eight-core"
    s = re.sub(r"\b(cpu|processor|with radeon graphics)\b", "", s)
    s = re.sub(r"[^a-z0-9]+", "-", s).strip("-") or "cpu"
    if numbers and not re.search(r"\d", s):
        s += "-" + cpu_generation(*numbers)
    return f"{s}-{cores}c-{threads}t"


def cpu_detail():
    """ "family F, model M, stepping S" from lscpu, to tell CPU generations apart."""
    vals = lscpu_fields()
    parts = [f"{k.lower()} {vals[k]}" for k in ("CPU family", "Model", "Stepping") if k in vals]
    if "Hypervisor vendor" in vals:
        parts.append(f"virtual machine ({vals['Hypervisor vendor']})")
    return ", ".join(parts)


def cache_line(level):
    """The cache of that level, as lscpu tells it, or else as CPUID tells it (a VM may show no
    cache in lscpu, and its CPUID may describe the host's)."""
    for line in sh(["lscpu"]).splitlines():
        if line.startswith(f"{level} cache:"):
            return line.split(":", 1)[1].strip()
    n = sh(["getconf", f"LEVEL{level[1:]}_CACHE_SIZE"]).strip()  # glibc reads it from CPUID
    return f"{int(n) / 2**20:g} MiB (CPUID)" if n.isdigit() and int(n) > 0 else "?"


def size_bytes(text):
    """Bytes of a size as lscpu or cache_line write it ("48 MiB (1 instance)"), or None."""
    m = re.match(r"\s*([\d.]+)\s*([KMG])i?B?\b", text or "")
    return int(float(m.group(1)) * 1024 ** " KMG".index(m.group(2))) if m else None


def meminfo(field):
    """A /proc/meminfo field in bytes, or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def mem_total():
    return meminfo("MemTotal")


def mem_available():
    """MemAvailable, bytes (MemTotal when the kernel does not say)."""
    return meminfo("MemAvailable") or mem_total() or 0


def machine_name_for_scale(threads):
    """The report's machine name, as the latency tables name it (without the kernels' suffix)."""
    return machine_slug(cpu_model(), physical_cores(), threads, cpu_numbers())


def write_machine_report(out, threads, suffix, lines):
    """Writes lines to OUT/<machine>-<suffix>.md; returns its path."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{machine_name_for_scale(threads)}-{suffix}.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path


def cpu_jiffies():
    """(busy, steal) seconds of all CPUs since boot, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    user, nice, system, _idle, _iowait, irq, softirq = v[:7]
    steal = v[7] if len(v) > 7 else 0
    return (user + nice + system + irq + softirq) / hz, steal / hz


def own_cpu_seconds():
    """CPU seconds used by this process and its waited-for children (the engine runs)."""
    import resource
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


class Background:
    """CPU time other processes use while the bench runs: all CPUs' busy time from /proc/stat
    minus this process's own (and its children's)."""

    def __init__(self):
        self.t, self.j, self.own = time.time(), cpu_jiffies(), own_cpu_seconds()

    def since(self):
        j = cpu_jiffies()
        if not (j and self.j):
            return None
        wall = time.time() - self.t
        other = max(0.0, (j[0] - self.j[0]) - (own_cpu_seconds() - self.own))
        return {"wall_s": wall, "other_cpu_s": other, "steal_s": j[1] - self.j[1],
                "other_frac": other / wall if wall > 0 else 0.0}


def git_describe():
    rev = sh(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"]).strip()
    if not re.fullmatch(r"[0-9a-f]+", rev):
        return "not a git checkout"
    dirty = sh(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"]).strip()
    return rev + (" with uncommitted changes" if dirty else "")


def survey(b):
    """The machine, and how busy other processes keep it over 2 s (--load-seconds) before the bench starts."""
    args, m = b.args, b.machine
    m.update(cpu=cpu_model(), cpu_detail=cpu_detail(), cores=physical_cores(), logical=logical_cpus(),
             mem=mem_total(), l2=cache_line("L2"), l3=cache_line("L3"), llc_bytes=size_bytes(cache_line("L3")),
             compiler=(sh([args.cc, "--version"]).splitlines() or ["?"])[0], git=git_describe(),
             date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
             load_start=os.getloadavg()[0])
    b.phase = "measuring the machine's load"
    bg = Background()
    time.sleep(args.load_seconds)
    m["bg_before"] = bg.since()
    busy = m["bg_before"]["other_frac"] if m["bg_before"] else 0.0
    log(f"bench: {m['cpu']}, {m['cores']} cores, {args.threads} threads; load average {m['load_start']:.2f}; "
        f"other processes busy {busy * 100:.0f}% of one CPU")
    if busy > 0.1 and not args.allow_disturbed:
        raise BenchError(f"other processes keep {busy * 100:.0f}% of one CPU busy, so the timings would be disturbed: "
                         f"stop them, or pass --allow-disturbed to write a report that says so")
    if busy > 0.1:
        log(f"bench: WARNING: other processes keep {busy * 100:.0f}% of one CPU busy: timings will be disturbed")
    b.bg = Background()
