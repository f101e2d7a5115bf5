//! Where a measurement's CPU went: the host's busy, idle and stolen time
//! (`/proc/stat`) and chosen processes' own (`/proc/<pid>/stat`), between
//! two samples. `kemari-bench ft` uses it to tell a stream limited by the
//! host's CPUs (no CPU idle, unprotected or protected) from one limited by
//! something else, and to say whose the CPU time was.

use std::time::Instant;

/// CPU times in clock ticks (`USER_HZ`, 100 on Linux/x86).
const TICKS_PER_S: f64 = 100.0;

/// The host's CPU time, summed over CPUs, in ticks.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct HostTicks {
    /// user, nice, system, irq and softirq.
    pub busy: u64,
    /// idle and iowait.
    pub idle: u64,
    /// Time this virtual machine's CPUs wanted but its host ran others.
    pub steal: u64,
}

/// Parses the `cpu` line of `/proc/stat`.
pub fn parse_host_ticks(stat: &str) -> Option<HostTicks> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    let at = |i: usize| v.get(i).copied().unwrap_or(0);
    // user nice system idle iowait irq softirq steal (guest time is in user)
    Some(HostTicks {
        busy: at(0) + at(1) + at(2) + at(5) + at(6),
        idle: at(3) + at(4),
        steal: at(7),
    })
}

/// Parses utime + stime (every thread of the process) from a
/// `/proc/<pid>/stat` line; the command name may hold spaces and ')'.
pub fn parse_process_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After the name: state is field 3 of the line, utime 14, stime 15.
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

fn host_ticks() -> Option<HostTicks> {
    parse_host_ticks(&std::fs::read_to_string("/proc/stat").ok()?)
}

fn process_ticks(pid: u32) -> Option<u64> {
    parse_process_ticks(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// A sample to measure from: [`CpuMark::take`], then [`CpuMark::since`].
#[derive(Debug, Clone)]
pub struct CpuMark {
    at: Instant,
    host: Option<HostTicks>,
    procs: Vec<(u32, Option<u64>)>,
}

/// CPU used between two marks.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CpuUse {
    /// Wall time, s.
    pub wall_s: f64,
    /// The host's busy CPU time, s (all CPUs).
    pub host_busy_s: f64,
    /// Share of all CPUs' time idle, 0–1.
    pub idle_share: f64,
    /// Share of all CPUs' time stolen by this machine's host, 0–1.
    pub steal_share: f64,
    /// Each process's CPU time, s, in the order given to [`CpuMark::take`]
    /// (`None`: it ended or could not be read).
    pub procs_s: Vec<Option<f64>>,
}

impl CpuMark {
    /// Samples the host and the processes `pids`.
    pub fn take(pids: &[u32]) -> CpuMark {
        CpuMark {
            at: Instant::now(),
            host: host_ticks(),
            procs: pids.iter().map(|&p| (p, process_ticks(p))).collect(),
        }
    }

    /// What was used since this mark.
    pub fn since(&self) -> CpuUse {
        let now = CpuMark {
            at: Instant::now(),
            host: host_ticks(),
            procs: self
                .procs
                .iter()
                .map(|&(p, _)| (p, process_ticks(p)))
                .collect(),
        };
        between(self, &now)
    }
}

fn between(a: &CpuMark, b: &CpuMark) -> CpuUse {
    let wall_s = b.at.duration_since(a.at).as_secs_f64();
    let (host_busy_s, idle_share, steal_share) = match (a.host, b.host) {
        (Some(x), Some(y)) => {
            let busy = y.busy.saturating_sub(x.busy) as f64;
            let idle = y.idle.saturating_sub(x.idle) as f64;
            let steal = y.steal.saturating_sub(x.steal) as f64;
            let all = (busy + idle + steal).max(1.0);
            (busy / TICKS_PER_S, idle / all, steal / all)
        }
        _ => (0.0, 0.0, 0.0),
    };
    let procs_s = a
        .procs
        .iter()
        .zip(&b.procs)
        .map(|(&(_, x), &(_, y))| Some(y?.saturating_sub(x?) as f64 / TICKS_PER_S))
        .collect();
    CpuUse {
        wall_s,
        host_busy_s,
        idle_share,
        steal_share,
        procs_s,
    }
}

impl CpuUse {
    /// Busy CPUs on average (2.0: both CPUs of a 2-CPU host all the time).
    pub fn busy_cpus(&self) -> f64 {
        if self.wall_s > 0.0 {
            self.host_busy_s / self.wall_s
        } else {
            0.0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_line_splits_busy_idle_and_steal() {
        let stat = "cpu  100 5 50 1000 20 3 2 40 0 0\ncpu0 50 2 25 500 10 1 1 20 0 0\n";
        assert_eq!(
            parse_host_ticks(stat),
            Some(HostTicks {
                busy: 160,
                idle: 1020,
                steal: 40
            })
        );
        assert_eq!(parse_host_ticks("intr 1 2 3\n"), None);
        assert_eq!(parse_host_ticks("cpu  1 x 3\n"), None);
    }

    #[test]
    fn process_line_survives_odd_names() {
        let stat = "4242 (kemari) x) R 1 2 3 4 5 6 7 8 9 10 250 30 0 0 20 0 9 0";
        assert_eq!(parse_process_ticks(stat), Some(280));
        assert_eq!(parse_process_ticks("4242 (short) R 1"), None);
        assert_eq!(parse_process_ticks("no parenthesis"), None);
    }

    #[test]
    fn use_between_marks_is_the_difference_and_its_shares() {
        let t = Instant::now();
        let a = CpuMark {
            at: t,
            host: Some(HostTicks {
                busy: 1000,
                idle: 500,
                steal: 0,
            }),
            procs: vec![(1, Some(100)), (2, None)],
        };
        let b = CpuMark {
            at: t + std::time::Duration::from_secs(2),
            host: Some(HostTicks {
                busy: 1360,
                idle: 520,
                steal: 20,
            }),
            procs: vec![(1, Some(250)), (2, Some(7))],
        };
        let u = between(&a, &b);
        assert!((u.host_busy_s - 3.6).abs() < 1e-9);
        assert!((u.idle_share - 0.05).abs() < 1e-9);
        assert!((u.steal_share - 0.05).abs() < 1e-9);
        assert!((u.busy_cpus() - 1.8).abs() < 1e-9);
        assert_eq!(u.procs_s, vec![Some(1.5), None]);
    }
}
