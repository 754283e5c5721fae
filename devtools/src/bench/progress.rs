//! The bench's progress on a terminal: a bar on stderr of the stages of the run done so
//! far (a phase in one tracing mode; a worker count of the scaling phase), the one
//! running and the time left.
//!
//! Owns the bar, the count of stages a run plans, and every line the bench writes to
//! stderr while the bar may be up ([`Progress::note`]), so that the bar never tears
//! them. It must never print the report (the Markdown on stdout, the JSON file), and
//! never draw anything unless stderr is a terminal: elsewhere the notes are the same
//! lines, byte for byte, as without it.

use std::fmt::{self, Display};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use indicatif::{
    HumanDuration, ProgressBar, ProgressDrawTarget, ProgressFinish, ProgressState, ProgressStyle,
};

use super::{Mode, Phase, Plan};

/// How often a visible bar redraws (its spinner, elapsed time and ETA) between stages.
const TICK: Duration = Duration::from_millis(250);
/// What a visible bar shows: the stage first, so that a narrow terminal cuts the bar
/// rather than it; `{left}` is [`time_left`].
const TEMPLATE: &str = "{spinner} {msg:<31} {pos}/{len} [{wide_bar}] {elapsed_precise}, ETA {left}";

/// The bench's progress bar, drawn on stderr, or hidden.
#[derive(Clone)]
pub struct Progress {
    bar: ProgressBar,
    /// Stages done, and when the last of them ended (since [`Progress::start`]).
    done: Arc<Mutex<(u64, Duration)>>,
}

impl Progress {
    /// A bar on stderr when `visible` (stderr is a terminal), or else one that draws
    /// nothing. It shows nothing before [`Progress::start`].
    pub fn new(visible: bool) -> Self {
        Self::with_target(if visible {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        })
    }

    fn with_target(target: ProgressDrawTarget) -> Self {
        let done = Arc::new(Mutex::new((0, Duration::ZERO)));
        let shared = Arc::clone(&done);
        let style = ProgressStyle::with_template(TEMPLATE)
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> ")
            .with_key(
                "left",
                move |state: &ProgressState, w: &mut dyn fmt::Write| {
                    let (done, at) = read(&shared);
                    let _ = w.write_str(&time_left(state.len(), state.elapsed(), done, at));
                },
            );
        let bar = ProgressBar::with_draw_target(None, target)
            .with_style(style)
            .with_message("starting")
            // Whatever ends the run, an error included, leaves no bar behind.
            .with_finish(ProgressFinish::AndClear);
        Self { bar, done }
    }

    /// Whether nothing is drawn.
    pub fn is_hidden(&self) -> bool {
        self.bar.is_hidden()
    }

    /// Shows the bar, `stages` long (see [`stages`]).
    pub fn start(&self, stages: u64) {
        self.bar.set_length(stages);
        self.bar.reset();
        if !self.is_hidden() {
            self.bar.enable_steady_tick(TICK);
        }
    }

    /// Names the stage that runs now: `phase` in `mode`, with what sets it apart
    /// (`detail`, such as a scaling phase's worker count).
    pub fn stage(&self, phase: Phase, mode: Mode, detail: Option<String>) {
        let phase = format!("{phase:?}").to_lowercase();
        let detail = detail.map(|d| format!(" {d}")).unwrap_or_default();
        self.bar
            .set_message(format!("{phase}{detail}, tracing {}", mode.label()));
    }

    /// Counts one stage done.
    pub fn done(&self) {
        // The bar's own lock is held while it draws and reads `done` (`{left}`): never
        // take it while holding `done`.
        let at = self.bar.elapsed();
        {
            let mut done = match self.done.lock() {
                Ok(done) => done,
                Err(poisoned) => poisoned.into_inner(),
            };
            *done = (done.0 + 1, at);
        }
        self.bar.inc(1);
    }

    /// Names what runs after the stages (cleanup).
    pub fn after(&self, what: &'static str) {
        self.bar.set_message(what);
    }

    /// Writes `line` to stderr, above the bar when it is drawn.
    pub fn note(&self, line: impl Display) {
        self.bar.suspend(|| eprintln!("{line}"));
    }

    /// Removes the bar, before the report prints.
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

fn read(done: &Mutex<(u64, Duration)>) -> (u64, Duration) {
    match done.lock() {
        Ok(done) => *done,
        Err(poisoned) => *poisoned.into_inner(),
    }
}

/// The time left if every stage takes as long as the stages done so far did on average,
/// `?` before the first one ends: `len` stages in all, `elapsed` since the start, `done`
/// of them ended by `at`.
fn time_left(len: Option<u64>, elapsed: Duration, done: u64, at: Duration) -> String {
    match len {
        Some(len) if done > 0 => {
            let projected = at.mul_f64(len as f64 / done as f64);
            format!("{:#}", HumanDuration(projected.saturating_sub(elapsed)))
        }
        _ => "?".into(),
    }
}

/// The stages of a run: each phase once in each of `modes`, the scaling phase once per
/// worker count; the scaling and memory phases not at all when `attach`ed (they are
/// skipped).
pub fn stages(phases: &[Phase], modes: &[Mode], plan: &Plan, attach: bool) -> u64 {
    let per_mode: usize = phases
        .iter()
        .map(|phase| match phase {
            Phase::Scaling
            | Phase::Memory
            | Phase::Http
            | Phase::Openai
            | Phase::Instructions
            | Phase::Tenants
                if attach =>
            {
                0
            }
            Phase::Scaling => plan.scaling_workers.len(),
            _ => 1,
        })
        .sum();
    (per_mode * modes.len()) as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::{BenchArgs, ALL_PHASES};
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        bench: BenchArgs,
    }

    fn plan(args: &[&str]) -> Plan {
        let cli = Cli::parse_from(std::iter::once("bench").chain(args.iter().copied()));
        Plan::from_args(&cli.bench)
    }

    #[test]
    fn hidden_off_a_terminal() {
        // Stderr not a terminal: nothing drawn, whatever the bench then does with it.
        let progress = Progress::new(false);
        assert!(progress.is_hidden());
        progress.start(3);
        progress.stage(Phase::Overhead, Mode::Off, None);
        progress.done();
        progress.after("cleaning up");
        progress.finish();
        assert!(progress.is_hidden());
    }

    #[test]
    fn stages_count_phases_modes_and_worker_counts() {
        let plan = plan(&["--quick"]);
        let both = [Mode::Off, Mode::On];
        // Ten phases, the scaling phase four times (1, 2, 4, 8 workers), in two modes.
        assert_eq!(stages(&ALL_PHASES, &both, &plan, false), 28);
        assert_eq!(stages(&[Phase::Overhead], &both, &plan, false), 2);
        // Attached: one mode, and no scaling, memory, http, openai or instructions phase.
        assert_eq!(stages(&ALL_PHASES, &[Mode::Attached], &plan, true), 5);
        let plan = self::plan(&["--workers", "2,4"]);
        assert_eq!(stages(&[Phase::Scaling], &[Mode::On], &plan, false), 2);
    }

    /// A terminal that keeps what is written to it.
    #[derive(Debug, Default, Clone)]
    struct Screen(Arc<Mutex<String>>);

    impl indicatif::TermLike for Screen {
        fn width(&self) -> u16 {
            100
        }
        fn move_cursor_up(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn move_cursor_down(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn move_cursor_right(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn move_cursor_left(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn write_line(&self, s: &str) -> std::io::Result<()> {
            self.write_str(&format!("{s}\n"))
        }
        fn write_str(&self, s: &str) -> std::io::Result<()> {
            if let Ok(mut screen) = self.0.lock() {
                screen.push_str(s);
            }
            Ok(())
        }
        fn clear_line(&self) -> std::io::Result<()> {
            Ok(())
        }
        fn flush(&self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn drawn_shows_stage_count_and_eta_without_deadlock() {
        let screen = Screen::default();
        let progress =
            Progress::with_target(ProgressDrawTarget::term_like(Box::new(screen.clone())));
        assert!(!progress.is_hidden());
        progress.start(20_000);
        // Draw as often as possible while stages end: the drawing thread reads `done`
        // under the bar's lock, `done()` writes it.
        progress.bar.enable_steady_tick(Duration::from_millis(1));
        let (sent, finished) = std::sync::mpsc::channel();
        let worker = progress.clone();
        std::thread::spawn(move || {
            worker.stage(Phase::Scaling, Mode::On, Some("4 workers".into()));
            for _ in 0..20_000 {
                worker.done();
            }
            let _ = sent.send(());
        });
        assert!(
            finished.recv_timeout(Duration::from_secs(20)).is_ok(),
            "the stages did not all end: a deadlock between the bar and done()"
        );
        progress.bar.disable_steady_tick();
        progress.bar.tick();
        let shown = screen.0.lock().map(|s| s.clone()).unwrap_or_default();
        assert!(shown.contains("scaling 4 workers, tracing on"), "{shown}");
        assert!(shown.contains("20000/20000"), "{shown}");
        assert!(shown.contains("ETA 0s"), "{shown}");
        progress.finish();
    }

    #[test]
    fn time_left_projects_the_mean_stage() {
        let s = Duration::from_secs;
        assert_eq!(time_left(Some(4), s(1), 0, s(0)), "?");
        assert_eq!(time_left(None, s(30), 1, s(10)), "?");
        // One of four stages took 10 s: 40 s in all, 25 s left 15 s in.
        assert_eq!(time_left(Some(4), s(15), 1, s(10)), "25s");
        // Late by the projection: none left, not a negative time.
        assert_eq!(time_left(Some(2), s(30), 1, s(10)), "0s");
    }
}
