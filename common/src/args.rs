//! The command line of the fleet's server binaries (`toolfleet-coordinator`,
//! `toolfleet-worker`, `toolfleet-gateway`): they take their settings from the
//! environment only, so the one thing their arguments may ask is `--help` (`-h`) or
//! `--version` (`-V`). Anything else is refused with exit code 2, so that a typo never
//! starts a server that connects to whatever the environment names.
//!
//! [`parse`] is the pure decision over a list of arguments; [`server_args`] reads the
//! process's own; [`ServerArgs::exit_unless_run`] prints the answer and exits. A `main`
//! calls it first, before telemetry, a runtime or any connection exists.

use std::ffi::OsString;
use std::io::Write;

/// The exit code of an argument that is refused (as a usage error is, by convention).
pub const REFUSED_EXIT_CODE: u8 = 2;

/// What a server binary's arguments ask for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerArgs {
    /// No argument: run the server.
    Run,
    /// `--help` or `-h`: this text on stdout, exit 0.
    Help(String),
    /// `--version` or `-V`: `<name> <version>` on stdout, exit 0.
    Version(String),
    /// Anything else: this one line on stderr, exit [`REFUSED_EXIT_CODE`].
    Refused(String),
}

impl ServerArgs {
    /// The exit code of an answer; `None` for [`ServerArgs::Run`].
    pub fn exit_code(&self) -> Option<u8> {
        match self {
            ServerArgs::Run => None,
            ServerArgs::Help(_) | ServerArgs::Version(_) => Some(0),
            ServerArgs::Refused(_) => Some(REFUSED_EXIT_CODE),
        }
    }

    /// Returns on [`ServerArgs::Run`]; otherwise prints the help or version text on
    /// stdout, or the refusal on stderr, and exits the process with its exit code.
    pub fn exit_unless_run(self) {
        let Some(code) = self.exit_code() else {
            return;
        };
        match self {
            ServerArgs::Run => {}
            ServerArgs::Help(text) | ServerArgs::Version(text) => {
                let mut out = std::io::stdout().lock();
                let _ = writeln!(out, "{}", text.trim_end());
                let _ = out.flush();
            }
            ServerArgs::Refused(line) => {
                let mut err = std::io::stderr().lock();
                let _ = writeln!(err, "{line}");
                let _ = err.flush();
            }
        }
        std::process::exit(i32::from(code));
    }
}

/// [`parse`] of this process's arguments (the program name left out).
pub fn server_args(name: &str, version: &str, help: &str) -> ServerArgs {
    parse(name, version, help, std::env::args_os().skip(1))
}

/// What `args` (the program name left out) ask of the server binary `name` at
/// `version`, whose description and settings are `help`. No argument runs it; `--help`
/// or `-h` answers `help` followed by the usage; `--version` or `-V` answers
/// `<name> <version>`. Any argument that is neither refuses the whole line, naming the
/// first such argument, even beside `--help`; where both flags are given the first
/// decides.
pub fn parse<I>(name: &str, version: &str, help: &str, args: I) -> ServerArgs
where
    I: IntoIterator,
    I::Item: Into<OsString>,
{
    let mut answer = None;
    for arg in args {
        let arg: OsString = arg.into();
        match arg.to_str() {
            Some("--help" | "-h") => {
                answer.get_or_insert_with(|| ServerArgs::Help(help_text(name, version, help)));
            }
            Some("--version" | "-V") => {
                answer.get_or_insert_with(|| ServerArgs::Version(format!("{name} {version}")));
            }
            _ => {
                return ServerArgs::Refused(format!(
                    "{name}: unexpected argument '{}'; it takes --help or --version, and \
                     reads its settings from the environment (see {name} --help)",
                    arg.to_string_lossy()
                ))
            }
        }
    }
    answer.unwrap_or(ServerArgs::Run)
}

/// `help`, then the usage line every server binary shares.
fn help_text(name: &str, version: &str, help: &str) -> String {
    format!(
        "{help}\n\n\
         Usage: {name} [--help | --version]\n\
         \x20 (none)         run until SIGTERM or Ctrl-C, with the settings of the environment\n\
         \x20 -h, --help     print this text and exit\n\
         \x20 -V, --version  print \"{name} {version}\" and exit\n",
        help = help.trim_end()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const NAME: &str = "toolfleet-thing";
    const VERSION: &str = "1.2.3";
    const HELP: &str = "toolfleet-thing: does a thing.\nReads TOOLFLEET_THING.";

    fn parsed(args: &[&str]) -> ServerArgs {
        parse(NAME, VERSION, HELP, args.iter().copied())
    }

    #[test]
    fn no_argument_runs() {
        assert_eq!(parsed(&[]), ServerArgs::Run);
        assert_eq!(parsed(&[]).exit_code(), None);
    }

    #[test]
    fn help_in_both_spellings_is_the_text_and_the_usage() {
        for flag in ["--help", "-h"] {
            let answer = parsed(&[flag]);
            let ServerArgs::Help(text) = &answer else {
                panic!("{flag}: {answer:?}");
            };
            assert!(text.starts_with(HELP), "{text}");
            assert!(text.contains("Usage: toolfleet-thing [--help | --version]"));
            assert!(text.contains("\"toolfleet-thing 1.2.3\""), "{text}");
            assert_eq!(answer.exit_code(), Some(0));
        }
    }

    #[test]
    fn version_in_both_spellings_is_the_name_and_the_version() {
        for flag in ["--version", "-V"] {
            let answer = parsed(&[flag]);
            assert_eq!(answer, ServerArgs::Version("toolfleet-thing 1.2.3".into()));
            assert_eq!(answer.exit_code(), Some(0));
        }
    }

    #[test]
    fn anything_else_is_refused_with_one_line_naming_it() {
        for args in [
            &["--hepl"][..],
            &["x"],
            &["-v"],
            &["--help=yes"],
            &[""],
            &["--"],
            &["--help", "--hepl"],
            &["--hepl", "--help"],
            &["--version", "run"],
        ] {
            let answer = parsed(args);
            let ServerArgs::Refused(line) = &answer else {
                panic!("{args:?}: {answer:?}");
            };
            let bad = args
                .iter()
                .find(|a| !["--help", "--version"].contains(a))
                .copied()
                .unwrap_or_default();
            assert!(
                line.starts_with(&format!("toolfleet-thing: unexpected argument '{bad}'")),
                "{line}"
            );
            assert!(line.contains("--help or --version"), "{line}");
            assert!(line.contains("environment"), "{line}");
            assert!(!line.contains('\n'), "{line}");
            assert_eq!(answer.exit_code(), Some(REFUSED_EXIT_CODE));
        }
    }

    #[test]
    fn the_first_of_help_and_version_decides() {
        assert!(matches!(parsed(&["-h", "-V"]), ServerArgs::Help(_)));
        assert!(matches!(
            parsed(&["--version", "--help"]),
            ServerArgs::Version(_)
        ));
    }

    #[cfg(unix)]
    #[test]
    fn an_argument_that_is_no_utf8_is_refused() {
        use std::os::unix::ffi::OsStringExt;
        let arg = OsString::from_vec(vec![b'-', 0xff]);
        let answer = parse(NAME, VERSION, HELP, [arg]);
        assert!(
            matches!(&answer, ServerArgs::Refused(line) if line.contains("'-\u{fffd}'")),
            "{answer:?}"
        );
    }
}
