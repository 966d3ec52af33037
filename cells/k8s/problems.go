package k8s

import (
	"fmt"
	"strings"

	"github.com/apiary-net/apiary/internal/textcut"
)

const (
	// maxListedProblems is how many problems a health report or a log
	// record spells out; the rest are only counted.
	maxListedProblems = 10
	// maxListedFiles is how many bad files the health message names.
	maxListedFiles = 10
	// maxProblemLen bounds the text of one problem (a YAML key or an
	// object's name can be arbitrarily long).
	maxProblemLen = 512
)

// problemList is a bounded account of any number of problems: the text of the
// first maxListedProblems, one line each, and how many there are in all. It
// is what the directory source keeps and reports instead of the joined errors
// of a file, which for a file of 100,000 bad documents would be megabytes.
type problemList struct {
	// file names the file in the "… and N more" line; empty for a list
	// that spans files.
	file  string
	first []string
	total int
}

// newProblemList returns the problems of err for file.
func newProblemList(file string, err error) *problemList {
	l := &problemList{file: file}
	l.add(err)
	return l
}

// add counts the problems in err: every error joined into it (errors.Join,
// also nested), and every line of each, as the decoder reports a YAML type
// error with one line per problem.
func (l *problemList) add(err error) {
	if err == nil {
		return
	}
	if pl, ok := err.(*problemList); ok {
		l.merge(pl)
		return
	}
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		for _, e := range j.Unwrap() {
			l.add(e)
		}
		return
	}
	for line := range strings.SplitSeq(err.Error(), "\n") {
		l.addLine(line)
	}
}

func (l *problemList) addLine(line string) {
	l.total++
	if len(l.first) < maxListedProblems {
		l.first = append(l.first, textcut.Cut(line, maxProblemLen))
	}
}

// addf adds one problem, formatted only if it is listed.
func (l *problemList) addf(format string, args ...any) {
	if len(l.first) >= maxListedProblems {
		l.total++
		return
	}
	l.addLine(fmt.Sprintf(format, args...))
}

// merge adds the problems of other (which may be nil): its listed ones while
// there is room, and its count.
func (l *problemList) merge(other *problemList) {
	if other == nil {
		return
	}
	for _, line := range other.first {
		if len(l.first) < maxListedProblems {
			l.first = append(l.first, line)
		}
	}
	l.total += other.total
}

// empty reports whether there are no problems.
func (l *problemList) empty() bool { return l == nil || l.total == 0 }

// Error lists the first problems, one a line, and says how many more there
// are.
func (l *problemList) Error() string {
	s := strings.Join(l.first, "\n")
	if more := l.total - len(l.first); more > 0 {
		prefix := ""
		if l.file != "" {
			prefix = l.file + ": "
		}
		s += fmt.Sprintf("\n%s… and %d more problems (%d in all)", prefix, more, l.total)
	}
	return s
}

// nameList is "a, b, c", or "a, b, c and 7 more" past max names.
func nameList(names []string, max int) string {
	if len(names) <= max {
		return strings.Join(names, ", ")
	}
	return fmt.Sprintf("%s and %d more", strings.Join(names[:max], ", "), len(names)-max)
}
