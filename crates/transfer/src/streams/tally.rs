//! Which round each page stream has finished, so that the destination
//! acknowledges a round only once every stream carried all of its pages.

/// What a destination's stream thread reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamEvent {
    /// Stream `stream` (0-based among the page streams) read `RoundEnd{round}`:
    /// every page it carried up to that round is in memory.
    RoundEnded {
        /// The stream.
        stream: usize,
        /// The round.
        round: u32,
    },
    /// The stream ended (the source closes the streams after the pre-copy)
    /// or failed, with what happened.
    Closed {
        /// The stream.
        stream: usize,
        /// What happened ("closed by the source", an I/O error…).
        reason: String,
    },
}

/// Where a round stands across the streams.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RoundStatus {
    /// Every stream ended the round.
    Complete,
    /// Some stream has not ended it yet.
    Pending,
    /// A stream ended before it ended the round.
    Failed(String),
}

/// The last round each stream ended.
#[derive(Debug, Clone)]
pub struct RoundTally {
    ended: Vec<u32>,
    closed: Vec<Option<String>>,
}

impl RoundTally {
    /// A tally of `streams` page streams, none past round 0.
    pub fn new(streams: usize) -> Self {
        RoundTally {
            ended: vec![0; streams],
            closed: vec![None; streams],
        }
    }

    /// Records what a stream reported. A stream's rounds only move
    /// forward: a round end that does not follow the last one, or from an
    /// unknown stream, is an error the caller reports.
    pub fn note(&mut self, event: StreamEvent) -> Result<(), String> {
        match event {
            StreamEvent::RoundEnded { stream, round } => {
                let Some(last) = self.ended.get_mut(stream) else {
                    return Err(format!("no page stream {}", stream + 1));
                };
                if round <= *last {
                    return Err(format!(
                        "page stream {} ended round {round} after round {last}",
                        stream + 1
                    ));
                }
                *last = round;
            }
            StreamEvent::Closed { stream, reason } => {
                let Some(slot) = self.closed.get_mut(stream) else {
                    return Err(format!("no page stream {}", stream + 1));
                };
                slot.get_or_insert(reason);
            }
        }
        Ok(())
    }

    /// Whether round `round` has ended on every stream.
    pub fn status(&self, round: u32) -> RoundStatus {
        let mut pending = false;
        for (i, (&ended, closed)) in self.ended.iter().zip(&self.closed).enumerate() {
            if ended >= round {
                continue;
            }
            match closed {
                Some(reason) => {
                    return RoundStatus::Failed(format!(
                        "page stream {} ended before round {round} did: {reason}",
                        i + 1
                    ))
                }
                None => pending = true,
            }
        }
        if pending {
            RoundStatus::Pending
        } else {
            RoundStatus::Complete
        }
    }

    /// The first failure of a stream, if any (whatever the round).
    pub fn failure(&self) -> Option<String> {
        self.closed
            .iter()
            .enumerate()
            .find_map(|(i, c)| c.as_ref().map(|r| format!("page stream {}: {r}", i + 1)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ended(stream: usize, round: u32) -> StreamEvent {
        StreamEvent::RoundEnded { stream, round }
    }

    #[test]
    fn a_round_is_complete_only_once_every_stream_ended_it() {
        let mut t = RoundTally::new(3);
        assert_eq!(t.status(1), RoundStatus::Pending);
        t.note(ended(0, 1)).unwrap();
        t.note(ended(2, 1)).unwrap();
        assert_eq!(t.status(1), RoundStatus::Pending);
        t.note(ended(1, 1)).unwrap();
        assert_eq!(t.status(1), RoundStatus::Complete);
        // A fast stream ahead in round 2 does not complete round 2.
        t.note(ended(0, 2)).unwrap();
        assert_eq!(t.status(2), RoundStatus::Pending);
        assert_eq!(t.status(1), RoundStatus::Complete);
    }

    #[test]
    fn a_stream_closed_before_the_round_fails_it_and_after_does_not() {
        let mut t = RoundTally::new(2);
        t.note(ended(0, 1)).unwrap();
        t.note(ended(1, 1)).unwrap();
        // The source closes the streams after the pre-copy: round 1 stays
        // complete.
        t.note(StreamEvent::Closed {
            stream: 1,
            reason: "closed by the source".into(),
        })
        .unwrap();
        assert_eq!(t.status(1), RoundStatus::Complete);
        match t.status(2) {
            RoundStatus::Failed(why) => {
                assert!(why.contains("page stream 2"), "{why}");
                assert!(why.contains("closed by the source"), "{why}");
            }
            other => panic!("{other:?}"),
        }
        assert!(t.failure().unwrap().contains("page stream 2"));
    }

    #[test]
    fn rounds_only_move_forward_and_streams_must_exist() {
        let mut t = RoundTally::new(1);
        t.note(ended(0, 2)).unwrap();
        assert!(t.note(ended(0, 2)).is_err());
        assert!(t.note(ended(0, 1)).is_err());
        assert!(t.note(ended(1, 3)).is_err());
        // A stream may skip a round in which it carried nothing only if the
        // source still ended it there: it always does, so a jump is fine.
        t.note(ended(0, 5)).unwrap();
        assert_eq!(t.status(4), RoundStatus::Complete);
    }
}
