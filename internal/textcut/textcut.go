// Package textcut bounds text that reaches people (health messages, log
// records): whatever a module or an input produces, what is shown stays small
// and says how much was left out.
package textcut

import (
	"fmt"
	"unicode/utf8"
)

// Cut returns s if it is at most max bytes long, else its first max bytes
// (cut back to a rune boundary) followed by "… (N more bytes)".
func Cut(s string, max int) string {
	if len(s) <= max {
		return s
	}
	cut := max
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return fmt.Sprintf("%s… (%d more bytes)", s[:cut], len(s)-cut)
}
