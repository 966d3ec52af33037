package selectors

import (
	"fmt"

	"github.com/spf13/pflag"
)

// InvalidModeFlag names the flag that says what an invalid policy does to
// the endpoints it selects.
const InvalidModeFlag = "policy-invalid-mode"

// Values of InvalidModeFlag.
const (
	// InvalidDeny: an invalid policy puts the endpoints its subjects
	// select into default deny in the directions it has rules in (it fails
	// closed).
	InvalidDeny = "deny"
	// InvalidIgnore: an invalid policy is left out, as if it did not
	// exist (it fails open).
	InvalidIgnore = "ignore"
)

// Config is the selectors cell's configuration.
type Config struct {
	// PolicyInvalidMode is InvalidDeny or InvalidIgnore.
	PolicyInvalidMode string
}

var defaultConfig = Config{PolicyInvalidMode: InvalidDeny}

// Flags implements cell.Flagger.
func (def Config) Flags(fs *pflag.FlagSet) {
	fs.String(InvalidModeFlag, def.PolicyInvalidMode,
		"What a policy that cannot be implemented does to the pods it selects: deny (they are default deny in the directions the policy has rules in, until it is fixed) or ignore (the policy is left out: the pods get what the other policies say)")
}

func (c Config) validate() error {
	switch c.PolicyInvalidMode {
	case InvalidDeny, InvalidIgnore:
		return nil
	}
	return fmt.Errorf("--%s=%q: want deny or ignore", InvalidModeFlag, c.PolicyInvalidMode)
}
